#!/usr/bin/env bash
# Stop the local Slurm cluster started by slurm/local/up.sh (idempotent).
#
#   bash slurm/local/down.sh           # cancel all jobs, stop slurmd, slurmctld, slurmdbd, mariadbd, munged
#   bash slurm/local/down.sh --purge   # ... and delete the state dir (job state, accounting DB, logs)
#                                      #     and the rendered slurm.conf / slurmdbd.conf
#
# Only daemons recorded in this cluster's PID files are stopped (a munged that up.sh found already
# running is left alone). Installed packages and the munge key are kept. See slurm/README.md.
set -euo pipefail
SCRIPT_NAME=slurm-down
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"

PURGE=0
for arg in "$@"; do
  case "$arg" in
    --purge) PURGE=1 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (usage: down.sh [--purge])" ;;
  esac
done

cancel_jobs() {
  daemon_running slurmctld || return 0
  command -v squeue >/dev/null || return 0
  local ids i
  ids="$(squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ')" || true
  [[ -n ${ids// /} ]] || return 0
  log "cancelling jobs: $ids"
  # shellcheck disable=SC2086  # one argument per job id
  scancel $ids 2>/dev/null || true
  # Jobs get SIGTERM, then SIGKILL after KillWait (5 s); wait for them to leave the queue so that no
  # slurmstepd or job process outlives slurmd.
  for ((i = 0; i < 200; i++)); do
    [[ -z "$(squeue -h -o '%A' 2>/dev/null)" ]] && return 0
    sleep 0.1
  done
  log "WARNING: jobs still listed after 20s: $(squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ')"
}

# slurmstepd processes outlive slurmd by design (so that a slurmd restart keeps jobs running). After
# cancelling all jobs there should be none; any left over belongs to this (the only) slurmd on the
# host, and is killed together with its descendants (the job's processes).
kill_leftover_stepds() {
  local p pid comm stat rest ppid
  local -A parent=() doomed=()
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    comm="" stat=""
    read -r comm 2>/dev/null <"$p/comm" || true
    read -r stat 2>/dev/null <"$p/stat" || true
    rest=${stat##*) } # "<pid> (<comm>) <state> <ppid> ...": skip past the comm field
    read -r _ ppid _ <<<"$rest" || true
    parent[$pid]=${ppid:-0}
    if [[ $comm == slurmstepd ]]; then doomed[$pid]=1; fi
  done
  if ((${#doomed[@]} == 0)); then return 0; fi
  local added=1
  while ((added)); do
    added=0
    for pid in "${!parent[@]}"; do
      if [[ -z ${doomed[$pid]:-} && -n ${doomed[${parent[$pid]}]:-} ]]; then
        doomed[$pid]=1
        added=1
      fi
    done
  done
  log "WARNING: killing leftover slurmstepd processes and their children: ${!doomed[*]}"
  kill -KILL "${!doomed[@]}" 2>/dev/null || true
}

main() {
  require_root
  take_lock 120 --or-continue
  local had_slurmd=0
  if daemon_running slurmd; then had_slurmd=1; fi
  cancel_jobs
  # slurmctld sends its last records to slurmdbd, and all of them need munged until they are gone.
  stop_daemons 15 slurmd slurmctld
  if ((had_slurmd)); then kill_leftover_stepds; fi
  stop_daemons 15 slurmdbd
  stop_daemons 60 mariadbd munged

  if ((PURGE)); then
    local f
    for f in "$SLURM_CONF" "$DBD_CONF"; do
      if [[ -f $f ]] && grep -qF "$MARKER" "$f"; then rm -f "$f" && log "removed $f"; fi
    done
    if [[ -d $STATE_DIR ]]; then
      [[ -e $STATE_DIR/.fp8rl-slurm-state ]] \
        || die "$STATE_DIR has no .fp8rl-slurm-state marker: not deleting a directory up.sh did not create"
      rm -rf "$STATE_DIR"
      log "removed $STATE_DIR"
    fi
  fi

  local d left=()
  for d in slurmd slurmctld slurmdbd mariadbd munged; do
    if daemon_running "$d"; then left+=("$d"); fi
  done
  ((${#left[@]} == 0)) || die "still running: ${left[*]}"
  log "down$( ((PURGE)) && echo ' (state purged)')"
}

main "$@"
