#!/usr/bin/env bash
# One host's side of launch_fleet.sh: starts, reports on and stops this host's
# supervised actors (scripts/launch_actors.sh), detached from the session that
# started them. launch_fleet.sh runs it over ssh (or ip netns exec); it can be
# run by hand too.
#
# Usage: scripts/fleet_host.sh start --state-dir DIR --learner HOST:PORT
#            [--num-actors N|auto] [--env ENV_ID] [--num-envs K] [--actor-prefix NAME]
#            [--token-stdin] [-- EXTRA_ACTOR_FLAGS...]
#        scripts/fleet_host.sh status --state-dir DIR
#        scripts/fleet_host.sh stop --state-dir DIR [--timeout-s S]
#
# start: --num-actors auto (the default) is one actor per core of this host.
#   --token-stdin reads the learner's token from the first line of stdin, so it
#   never shows on a command line; the actors get it as SEEDRL_AUTH_TOKEN.
#   Logs, the supervisor's pid and its status go to DIR. Refuses to start a
#   second fleet in a DIR whose supervisor still runs.
# status: one line, "STATE key=value...": STATE is running, finished, refused,
#   stopped, died (the supervisor vanished) or absent; then alive/actors,
#   restarts, streaming (actors whose latest line says they stream to the
#   learner), reconnecting, and env_steps_per_s (the sum of their latest reports).
# stop: SIGTERM to the supervisor, which stops its actors; after S seconds
#   (default 20) whatever is left of its process group gets SIGKILL.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}" >&2
  exit 2
}
fail() { echo "fleet_host: $*" >&2; echo >&2; usage; }

[ $# -gt 0 ] || usage
action=$1
shift
case "$action" in
  start|status|stop) ;;
  -h|--help) usage ;;
  *) fail "unknown action '$action' (start, status or stop)" ;;
esac

state_dir="" learner="" num_actors=auto env="atari:Pong" num_envs=8 prefix=$(hostname)
token_stdin=0 timeout_s=20
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --state-dir) state_dir=${2:-}; shift 2 || fail "--state-dir needs a value" ;;
    --learner) learner=${2:-}; shift 2 || fail "--learner needs a value" ;;
    --num-actors) num_actors=${2:-}; shift 2 || fail "--num-actors needs a value" ;;
    --env) env=${2:-}; shift 2 || fail "--env needs a value" ;;
    --num-envs) num_envs=${2:-}; shift 2 || fail "--num-envs needs a value" ;;
    --actor-prefix) prefix=${2:-}; shift 2 || fail "--actor-prefix needs a value" ;;
    --token-stdin) token_stdin=1; shift ;;
    --timeout-s) timeout_s=${2:-}; shift 2 || fail "--timeout-s needs a value" ;;
    -h|--help) usage ;;
    --) shift; extra=("$@"); break ;;
    *) fail "unknown argument '$1'" ;;
  esac
done
[ -n "$state_dir" ] || fail "--state-dir DIR is required"
[[ "$timeout_s" =~ ^[0-9]+$ ]] || fail "--timeout-s must be a whole number of seconds"
pid_file="$state_dir/supervisor.pid"
status_file="$state_dir/status"

# The supervisor's pid while it runs, else nothing.
running_pid() {
  local pid
  pid=$(cat "$pid_file" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  # A recycled pid is not ours: ours runs launch_actors.sh.
  grep -qa launch_actors.sh "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

# Actors left in the process group of a supervisor that died (kill -9, OOM).
# The kernel reuses no pid while a group of that id has members, so they are ours.
orphans() {
  local pid
  pid=$(cat "$pid_file" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  pgrep -g "$pid" -f seedrl-actor
}

field() { sed -n "s/.*\\b$1=\\([^ ]*\\).*/\\1/p" "$status_file" 2>/dev/null; }

case "$action" in
start)
  [ -n "$learner" ] || fail "--learner HOST:PORT is required"
  if [ "$num_actors" = auto ]; then num_actors=$(nproc); fi
  mkdir -p "$state_dir" || exit 1
  # One start at a time per state directory (two commands racing on it).
  exec 9>"$state_dir/start.lock"
  flock -n 9 || { echo "fleet_host: another start in $state_dir is under way" >&2; exit 1; }
  if pid=$(running_pid); then
    echo "fleet_host: a fleet already runs from $state_dir (supervisor pid $pid); stop it first" >&2
    exit 1
  fi
  if pids=$(orphans); then
    echo "fleet_host: actors of a fleet whose supervisor died still run from $state_dir" \
      "(pids $(echo $pids)); stop them first" >&2
    exit 1
  fi
  # The last run's logs stay readable, and its actors count no more in status.
  if [ -d "$state_dir/actors" ]; then
    rm -rf "$state_dir/actors.prev" && mv "$state_dir/actors" "$state_dir/actors.prev"
  fi
  mkdir -p "$state_dir/actors" || exit 1
  if [ $token_stdin -eq 1 ]; then
    IFS= read -r SEEDRL_AUTH_TOKEN || { echo "fleet_host: no token on stdin" >&2; exit 2; }
    export SEEDRL_AUTH_TOKEN
  fi
  rm -f "$status_file"
  # Its own session: it outlives this command, the ssh connection and a hangup.
  setsid "$root/scripts/launch_actors.sh" --learner "$learner" --num-actors "$num_actors" \
    --env "$env" --num-envs "$num_envs" --actor-prefix "$prefix" \
    --log-dir "$state_dir/actors" --status-file "$status_file" \
    ${extra[@]+-- "${extra[@]}"} </dev/null >>"$state_dir/supervisor.log" 2>&1 9>&- &
  pid=$!
  echo "$pid" >"$pid_file"
  # Arguments are checked before it writes its first status: wait for either.
  for _ in $(seq 100); do
    [ -s "$status_file" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if ! kill -0 "$pid" 2>/dev/null && [ ! -s "$status_file" ]; then
    wait "$pid"
    code=$?
    echo "fleet_host: launch_actors.sh exited with $code:" >&2
    tail -n 20 "$state_dir/supervisor.log" >&2
    exit "$code"
  fi
  echo "started $num_actors actors x $num_envs envs of $env -> $learner (supervisor pid $pid)"
  ;;

status)
  if [ ! -s "$status_file" ]; then echo "absent"; exit 0; fi
  state=$(field state)
  if [ "$state" = running ] && ! running_pid >/dev/null; then state=died; fi
  streaming=0 reconnecting=0 rate=0
  for log in "$state_dir"/actors/actor-*.log; do
    [ "$state" = running ] && [ -e "$log" ] || continue
    last=$(grep -E "connected to learner|env steps/s|retrying in|exits|refused" "$log" | tail -n 1)
    case "$last" in
      *"env steps/s"*)
        streaming=$((streaming + 1))
        rate=$((rate + $(sed -n 's/.*: \([0-9]*\) env steps\/s.*/\1/p' <<<"$last"))) ;;
      *"connected to learner"*) streaming=$((streaming + 1)) ;;
      *"retrying in"*) reconnecting=$((reconnecting + 1)) ;;
    esac
  done
  alive=$(field alive)
  [ "$state" = running ] || alive=0
  echo "$state alive=${alive:-0}/$(field actors) restarts=$(field restarts)" \
    "streaming=$streaming reconnecting=$reconnecting env_steps_per_s=$rate"
  ;;

stop)
  # stop_group PGID TARGET: SIGTERM to TARGET, then up to --timeout-s for the
  # process group PGID to empty; SIGKILL to what is left of it (and status 1).
  stop_group() {
    kill -TERM -- "$2" 2>/dev/null
    for _ in $(seq $((timeout_s * 10))); do
      pgrep -g "$1" >/dev/null || return 0
      sleep 0.1
    done
    kill -KILL -- "-$1" 2>/dev/null
    return 1
  }
  if pid=$(running_pid); then
    # The supervisor stops its actors itself.
    if stop_group "$pid" "$pid"; then echo "stopped"; else echo "stopped (killed after ${timeout_s} s)"; fi
  elif pids=$(orphans); then
    # The supervisor died but its actors did not: they would retry forever.
    pgid=$(cat "$pid_file")
    stop_group "$pgid" "-$pgid"
    echo "stopped $(echo $pids | wc -w) actors left by a supervisor that died"
  else
    echo "not running"
  fi
  ;;
esac
