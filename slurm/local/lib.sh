# shellcheck shell=bash
# shellcheck disable=SC2034  # variables are used by up.sh / down.sh, which source this file
# Shared settings and helpers for slurm/local/up.sh and slurm/local/down.sh. Sourced, not executed.
#
# Environment knobs (all optional):
#   SLURM_CONF                 where slurm.conf is written/read      [/etc/slurm/slurm.conf]
#                              (slurmdbd.conf goes next to it; with a non-default path, export the same
#                              SLURM_CONF in every shell that runs sbatch/srun/sacct/submitit)
#   FP8RL_SLURM_STATE_DIR      state, logs, PID files, MariaDB data   [/var/lib/fp8rl-slurm]
#   FP8RL_SLURM_UP_TIMEOUT     seconds up.sh waits for readiness      [60]
#   FP8RL_SLURM_OVERSUBSCRIBE  jobs that may share one core (1: none)  [4]
#   FP8RL_SLURM_CTLD_PORT / FP8RL_SLURM_SLURMD_PORT / FP8RL_SLURM_DBD_PORT   [6817 / 6818 / 6819]

# Absolute paths: the daemons change their working directory.
SLURM_CONF="$(realpath -m "${SLURM_CONF:-/etc/slurm/slurm.conf}")"
export SLURM_CONF
STATE_DIR="$(realpath -m "${FP8RL_SLURM_STATE_DIR:-/var/lib/fp8rl-slurm}")"
CONF_DIR="$(dirname "$SLURM_CONF")"
DBD_CONF="$CONF_DIR/slurmdbd.conf"
RUN_DIR="$STATE_DIR/run"
LOG_DIR="$STATE_DIR/log"
DB_DIR="$STATE_DIR/mysql"
DB_RUN_DIR="$RUN_DIR/mysql"
DB_SOCK="$DB_RUN_DIR/mysqld.sock"
MUNGE_RUN_DIR="$RUN_DIR/munge"
MUNGE_SOCKET_DIR=/run/munge
MUNGE_KEY=/etc/munge/munge.key
CLUSTER=fp8rl
PARTITION=local
CTLD_PORT="${FP8RL_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${FP8RL_SLURM_SLURMD_PORT:-6818}"
DBD_PORT="${FP8RL_SLURM_DBD_PORT:-6819}"
OVERSUBSCRIBE="${FP8RL_SLURM_OVERSUBSCRIBE:-4}"
MARKER="# Managed by fp8rl slurm/local/up.sh"
NODE="$(hostname -s)"

# daemon name -> PID file. The name is also the expected /proc/<pid>/comm, so a stale PID file whose
# PID was reused by another program is never acted upon.
declare -A PIDFILE=(
  [munged]="$MUNGE_RUN_DIR/munged.pid"
  [mariadbd]="$DB_RUN_DIR/mariadbd.pid"
  [slurmdbd]="$RUN_DIR/slurmdbd.pid"
  [slurmctld]="$RUN_DIR/slurmctld.pid"
  [slurmd]="$RUN_DIR/slurmd.pid"
)

# Elapsed time from /proc/uptime (monotonic, no fork), in centiseconds.
uptime_cs() { local up _; read -r up _ </proc/uptime; printf '%d\n' "$((10#${up/./}))"; }
_T0_CS="$(uptime_cs)"
elapsed() { local d=$(($(uptime_cs) - _T0_CS)); printf '%d.%02ds' $((d / 100)) $((d % 100)); }
log() { printf '[%s %(%H:%M:%S)T +%s] %s\n' "${SCRIPT_NAME:-slurm}" -1 "$(elapsed)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

require_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, runs munged/slurmctld/slurmd/slurmdbd/mariadbd)"
}

# take_lock: serialise up.sh/down.sh runs (e.g. two test sessions starting the cluster at once would
# otherwise start two slurmctld, and the second one kills the first). Held until the script exits.
# Every daemon must be started with `9>&-`: an inherited fd 9 would hold the lock for its lifetime.
# take_lock WAIT_S [--or-continue]
take_lock() {
  local wait_s=$1 lock_dir=/run/lock
  [[ -d $lock_dir ]] || lock_dir=/tmp
  exec 9>"$lock_dir/fp8rl-slurm.lock"
  flock -n 9 && return 0
  log "waiting (up to ${wait_s}s) for another slurm/local/up.sh or down.sh to finish"
  flock -w "$wait_s" 9 && return 0
  [[ ${2:-} == --or-continue ]] || die "could not get $lock_dir/fp8rl-slurm.lock within ${wait_s}s"
  log "WARNING: $lock_dir/fp8rl-slurm.lock still held after ${wait_s}s; continuing without it"
}

# daemon_pid NAME: print the PID of our running daemon NAME, or fail.
daemon_pid() {
  local name=$1 f=${PIDFILE[$1]} pid="" comm=""
  [[ -s $f ]] || return 1
  read -r pid <"$f" || true
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm ]] || return 1
  read -r comm 2>/dev/null <"/proc/$pid/comm" || true
  [[ $comm == "$name" ]] || return 1
  printf '%s\n' "$pid"
}
daemon_running() { daemon_pid "$1" >/dev/null; }

# stop_daemons GRACE_S NAME...: SIGTERM the named daemons (via their PID files) together, wait for all
# of them, SIGKILL whatever is left after GRACE_S. Daemons that are not running are skipped.
stop_daemons() {
  local grace=$1 name pid i
  shift
  local -A pids=()
  for name in "$@"; do
    if pid="$(daemon_pid "$name")"; then
      log "stopping $name (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      pids[$name]=$pid
    fi
  done
  for ((i = 0; i < grace * 10; i++)); do
    for name in "${!pids[@]}"; do
      if [[ ! -d /proc/${pids[$name]} ]]; then unset "pids[$name]"; fi
    done
    ((${#pids[@]} == 0)) && break
    sleep 0.1
  done
  for name in "${!pids[@]}"; do
    log "$name (pid ${pids[$name]}) ignored SIGTERM for ${grace}s: SIGKILL"
    kill -KILL "${pids[$name]}" 2>/dev/null || true
  done
  for ((i = 0; i < 50; i++)); do
    for name in "${!pids[@]}"; do
      if [[ ! -d /proc/${pids[$name]} ]]; then unset "pids[$name]"; fi
    done
    ((${#pids[@]} == 0)) && break
    sleep 0.1
  done
  for name in "$@"; do rm -f "${PIDFILE[$name]}"; done
}

munge_works() { munge -n -t 10 2>/dev/null | unmunge >/dev/null 2>&1; }
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
dbd_up() { sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }
# Node state in sinfo's long form (idle, mixed, allocated, down*, drained, inval, ...).
node_state() { { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null || true; } | head -n1; }

# Print the tail of every daemon log (for failures).
dump_logs() {
  local f
  for f in "$LOG_DIR"/*.log; do
    [[ -f $f ]] || continue
    printf '\n===== %s (last 25 lines) =====\n' "$f" >&2
    tail -n 25 "$f" >&2 || true
  done
  if command -v scontrol >/dev/null && ctld_up; then
    printf '\n===== scontrol show node %s =====\n' "$NODE" >&2
    scontrol show node "$NODE" >&2 2>&1 || true
  fi
}
