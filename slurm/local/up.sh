#!/usr/bin/env bash
# Start a real one-node Slurm cluster on this machine for development and CI (idempotent).
#
#   bash slurm/local/up.sh            # install if missing, configure, start, wait until usable
#
# Installs Debian's munge, slurmctld, slurmd, slurm-client, slurmdbd and mariadb-server if missing,
# renders slurm/local/*.conf.in into $SLURM_CONF (default /etc/slurm/slurm.conf) and slurmdbd.conf next
# to it, starts munged, mariadbd (unix socket only), slurmdbd, slurmctld and slurmd as background daemons
# with PID files under $FP8RL_SLURM_STATE_DIR (default /var/lib/fp8rl-slurm), then waits until the node
# is idle and an `srun true` step succeeds. When everything is already up it only re-checks readiness.
# Needs root and no systemd. Stop with slurm/local/down.sh. See slurm/README.md.
set -euo pipefail
SCRIPT_NAME=slurm-up
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"

TIMEOUT="${FP8RL_SLURM_UP_TIMEOUT:-60}"
PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server)
POLICY=/usr/sbin/policy-rc.d
POLICY_BACKUP=/usr/sbin/policy-rc.d.fp8rl-backup
POLICY_TAG="# fp8rl slurm/local/up.sh: temporary, deny daemon starts during apt-get install"

case "${1:-}" in
  "") ;;
  -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (usage: up.sh)" ;;
esac

# ----------------------------------------------------------------------------------------------- install
# Package postinst scripts try to start the daemons, which fails without systemd. A policy-rc.d that
# exits 101 denies those starts; ours is temporary and any pre-existing one is put back afterwards.
restore_policy() {
  if [[ -f $POLICY ]] && grep -qF "$POLICY_TAG" "$POLICY"; then rm -f "$POLICY"; fi
  if [[ -e $POLICY_BACKUP ]]; then mv -f "$POLICY_BACKUP" "$POLICY"; fi
}
trap restore_policy EXIT
trap 'exit 130' INT TERM # run the EXIT trap on Ctrl-C / kill too

install_packages() {
  local missing=() p t0
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then return 0; fi
  command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and no apt-get: install them first"
  log "installing ${missing[*]} (log: $LOG_DIR/apt.log)"
  t0="$(date +%s)"
  restore_policy
  if [[ -e $POLICY ]]; then mv -f "$POLICY" "$POLICY_BACKUP"; fi
  printf '#!/bin/sh\n%s\nexit 101\n' "$POLICY_TAG" >"$POLICY"
  chmod 0755 "$POLICY"
  # Wait up to 5 min for the dpkg lock if someone else is installing packages.
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -y -q)
  if ! "${apt[@]}" install --no-install-recommends "${missing[@]}" >>"$LOG_DIR/apt.log" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    "${apt[@]}" update >>"$LOG_DIR/apt.log" 2>&1 || true
    "${apt[@]}" install --no-install-recommends "${missing[@]}" >>"$LOG_DIR/apt.log" 2>&1 \
      || { tail -n 30 "$LOG_DIR/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
  fi
  restore_policy
  log "installed packages in $(($(date +%s) - t0))s"
}

# ------------------------------------------------------------------------------------ directories, key
prepare_dirs() {
  install -d -m 0755 "$STATE_DIR" "$STATE_DIR/ctld" "$STATE_DIR/slurmd" "$RUN_DIR" "$LOG_DIR" "$CONF_DIR"
  install -d -m 0755 -o munge -g munge "$MUNGE_RUN_DIR" "$MUNGE_SOCKET_DIR"
  install -d -m 0755 -o mysql -g mysql "$DB_RUN_DIR"
  # Logs written by the unprivileged munge / mysql users.
  [[ -e $LOG_DIR/munged.log ]] || install -m 0640 -o munge -g munge /dev/null "$LOG_DIR/munged.log"
  [[ -e $LOG_DIR/mariadb.log ]] || install -m 0640 -o mysql -g mysql /dev/null "$LOG_DIR/mariadb.log"
  if [[ ! -s $MUNGE_KEY ]]; then
    log "creating munge key $MUNGE_KEY"
    install -d -m 0700 -o munge -g munge "$(dirname "$MUNGE_KEY")"
    mungekey --create --keyfile="$MUNGE_KEY"
  fi
  chown munge:munge "$MUNGE_KEY"
  chmod 0400 "$MUNGE_KEY"
}

# ------------------------------------------------------------------------------------------ configuration
CHANGED_SLURM_CONF=0
CHANGED_DBD_CONF=0

node_hardware() {
  # `slurmd -C` prints e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2
  # ThreadsPerCore=1 RealMemory=24105". RealMemory is lowered to 90% (a node that reports less
  # memory than configured is set to INVAL).
  local line hw="" kv mem
  line="$(slurmd -C 2>/dev/null | head -n1)" || true
  [[ $line == NodeName=* ]] || die "could not read hardware with 'slurmd -C' (got: '$line')"
  for kv in $line; do
    case "$kv" in
      NodeName=*) ;;
      RealMemory=*) mem="${kv#RealMemory=}"; hw+=" RealMemory=$((mem * 9 / 10))" ;;
      *) hw+=" $kv" ;;
    esac
  done
  printf '%s\n' "${hw# }"
}

render() { # render TEMPLATE -> stdout
  local oversubscribe=NO
  [[ $OVERSUBSCRIBE =~ ^[0-9]+$ ]] || die "FP8RL_SLURM_OVERSUBSCRIBE must be a number, got '$OVERSUBSCRIBE'"
  if ((OVERSUBSCRIBE > 1)); then oversubscribe="FORCE:$OVERSUBSCRIBE"; fi
  sed -e "s|@OVERSUBSCRIBE@|$oversubscribe|g" -e "s|@CLUSTER@|$CLUSTER|g" -e "s|@NODE@|$NODE|g" -e "s|@NODE_HW@|$NODE_HW|g" -e "s|@SLURM_CONF@|$SLURM_CONF|g" \
    -e "s|@PARTITION@|$PARTITION|g" -e "s|@STATE_DIR@|$STATE_DIR|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" "$1"
}

# install_conf TEMPLATE DEST MODE: write DEST if its content differs; return 0 if it was (re)written.
install_conf() {
  local template=$1 dest=$2 mode=$3 tmp
  tmp="$(mktemp "$dest.XXXXXX")"
  render "$template" >"$tmp"
  if grep -q '@[A-Z_]*@' "$tmp"; then rm -f "$tmp"; die "unrendered placeholder in $template"; fi
  if [[ -f $dest ]] && cmp -s "$tmp" "$dest"; then rm -f "$tmp"; return 1; fi
  if [[ -f $dest ]] && ! grep -qF "$MARKER" "$dest"; then
    rm -f "$tmp"
    die "$dest exists and was not written by this script; refusing to overwrite it." \
      "Move it away, or set SLURM_CONF=/some/dir/slurm.conf to use another location."
  fi
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$dest"
  log "wrote $dest"
  return 0
}

write_configs() {
  NODE_HW="$(node_hardware)"
  if install_conf "$HERE/slurm.conf.in" "$SLURM_CONF" 0644; then CHANGED_SLURM_CONF=1; fi
  if install_conf "$HERE/slurmdbd.conf.in" "$DBD_CONF" 0600; then CHANGED_DBD_CONF=1; fi
  # Read by slurmd at every job start: no restart needed when it changes.
  install_conf "$HERE/prolog.sh.in" "$STATE_DIR/prolog.sh" 0755 || true
}

# ------------------------------------------------------------------------------------------------ daemons
STARTED=()

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds.
wait_for() {
  local secs=$1 what=$2 deadline
  shift 2
  deadline=$(($(date +%s) + secs))
  until "$@"; do
    if (($(date +%s) >= deadline)); then
      dump_logs
      die "$what not ready after ${secs}s (logs above, all logs in $LOG_DIR)"
    fi
    sleep 0.2
  done
}

start_munged() {
  daemon_running munged && return 0
  if munge_works; then
    log "using a munged that this script did not start (down.sh will leave it running)"
    return 0
  fi
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --pid-file="${PIDFILE[munged]}" --log-file="$LOG_DIR/munged.log" \
    </dev/null >>"$LOG_DIR/munged.log" 2>&1 9>&- || { dump_logs; die "munged failed to start"; }
  wait_for 10 munged munge_works
  STARTED+=(munged)
}

mariadb_args() {
  printf '%s\n' --no-defaults --user=mysql --datadir="$DB_DIR" --socket="$DB_SOCK" --skip-networking \
    --skip-name-resolve --innodb-buffer-pool-size=256M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900
}

db_ping() { mariadb-admin --no-defaults --socket="$DB_SOCK" --connect-timeout=2 ping >/dev/null 2>&1; }

start_mariadb() {
  daemon_running mariadbd && return 0
  local args
  mapfile -t args < <(mariadb_args)
  if [[ ! -d $DB_DIR/mysql ]]; then
    log "initialising MariaDB data directory $DB_DIR"
    rm -rf "$DB_DIR"
    mariadb-install-db "${args[@]}" --auth-root-authentication-method=socket --skip-test-db \
      >>"$LOG_DIR/mariadb-install.log" 2>&1 || { tail -n 30 "$LOG_DIR/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  log "starting mariadbd (unix socket $DB_SOCK, no TCP)"
  # mariadbd does not daemonize itself: detach it (own session, cwd /, parent = init).
  (
    cd /
    setsid /usr/sbin/mariadbd "${args[@]}" --pid-file="${PIDFILE[mariadbd]}" --log-error="$LOG_DIR/mariadb.log" \
      </dev/null >>"$LOG_DIR/mariadb.log" 2>&1 9>&- &
  )
  wait_for 30 mariadbd db_ping
  STARTED+=(mariadbd)
}

start_slurmdbd() {
  if ! daemon_running slurmdbd; then
    log "starting slurmdbd"
    MYSQL_UNIX_PORT="$DB_SOCK" slurmdbd </dev/null >>"$LOG_DIR/slurmdbd.stdout" 2>&1 9>&- \
      || { dump_logs; die "slurmdbd failed to start"; }
    STARTED+=(slurmdbd)
  fi
  wait_for 30 slurmdbd dbd_up
  if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
    log "registering cluster '$CLUSTER' in slurmdbd"
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
}

start_slurmctld() {
  daemon_running slurmctld && return 0
  log "starting slurmctld"
  slurmctld </dev/null >>"$LOG_DIR/slurmctld.stdout" 2>&1 9>&- || { dump_logs; die "slurmctld failed to start"; }
  wait_for 20 slurmctld ctld_up
  STARTED+=(slurmctld)
}

start_slurmd() {
  daemon_running slurmd && return 0
  log "starting slurmd"
  slurmd </dev/null >>"$LOG_DIR/slurmd.stdout" 2>&1 9>&- || { dump_logs; die "slurmd failed to start"; }
  STARTED+=(slurmd)
}

# ----------------------------------------------------------------------------------------------- readiness
srun_probe() {
  timeout 30 srun -p "$PARTITION" -N1 -n1 -t 1 -J fp8rl-up-probe --immediate=20 --quiet true >/dev/null 2>&1
}

# check_ready SECONDS: node idle and `srun true` works (or node busy with jobs); 1 on timeout.
check_ready() {
  local secs=$1 deadline state resumed=0 gone=0 d
  deadline=$(($(date +%s) + secs))
  while (($(date +%s) < deadline)); do
    # The daemons exit 0 even when they die right after forking: notice that early.
    for d in slurmctld slurmd; do
      if ! daemon_running "$d"; then
        if ((++gone > 15)); then
          dump_logs
          die "$d is not running: it exited after starting (its log is above)"
        fi
        sleep 0.2
        continue 2
      fi
    done
    gone=0
    state="$(node_state)"
    # Flags that do not affect usability: - (planned), + (more states), $ (maintenance), @ ^ (reboot).
    state="${state%%[-+\$@^]}"
    case "$state" in
      idle)
        if srun_probe; then return 0; fi
        ;;
      mixed | allocated | completing)
        log "node $NODE is busy ($state): skipping the srun probe"
        return 0
        ;;
      inval)
        dump_logs
        die "node $NODE is INVAL: its hardware does not match slurm.conf (see 'slurmd -C')"
        ;;
      down | drained | draining | drain)
        if ((resumed == 0)) && daemon_running slurmd; then
          log "node $NODE is $state ($(sinfo -h -N -n "$NODE" -o '%E' 2>/dev/null)); resuming it"
          scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
          resumed=1
        fi
        ;;
    esac
    sleep 0.3
  done
  return 1
}

all_running() {
  local d
  for d in mariadbd slurmdbd slurmctld slurmd; do daemon_running "$d" || return 1; done
  munge_works
}

main() {
  require_root
  take_lock 600 # a first run installs packages
  [[ $NODE =~ ^[A-Za-z0-9][A-Za-z0-9-]*$ ]] || die "unsupported short hostname '$NODE' for a Slurm NodeName"
  if [[ -d $STATE_DIR && ! -e $STATE_DIR/.fp8rl-slurm-state && -n "$(ls -A "$STATE_DIR")" ]]; then
    die "$STATE_DIR is not empty and has no .fp8rl-slurm-state marker: choose another FP8RL_SLURM_STATE_DIR"
  fi
  install -d -m 0755 "$STATE_DIR" "$LOG_DIR"
  touch "$STATE_DIR/.fp8rl-slurm-state"
  install_packages
  prepare_dirs
  write_configs

  if ((CHANGED_SLURM_CONF == 0 && CHANGED_DBD_CONF == 0)) && all_running && check_ready 15; then
    log "already up and ready: node $NODE, partition '$PARTITION' (SLURM_CONF=$SLURM_CONF)"
    return 0
  fi

  # Configuration changed under running daemons: restart the ones that read it.
  if ((CHANGED_SLURM_CONF || CHANGED_DBD_CONF)); then
    stop_daemons 15 slurmd slurmctld
    if ((CHANGED_DBD_CONF)); then stop_daemons 15 slurmdbd; fi
  fi

  start_munged
  start_mariadb
  start_slurmdbd
  start_slurmctld
  start_slurmd
  if ! check_ready "$TIMEOUT"; then
    dump_logs
    die "cluster not ready after ${TIMEOUT}s: node state '$(node_state)' (logs above, all logs in $LOG_DIR)"
  fi
  log "up and ready: node $NODE, partition '$PARTITION', started: ${STARTED[*]:-nothing}" \
    "(SLURM_CONF=$SLURM_CONF, logs in $LOG_DIR)"
}

main "$@"
