#!/usr/bin/env bash
# Starts N actor processes on this host and restarts any that dies.
#
# Usage: scripts/launch_actors.sh --learner HOST:PORT --num-actors N
#            [--env ENV_ID] [--num-envs K] [--actor-prefix NAME] [--log-dir DIR]
#            [--status-file FILE] [-- EXTRA_ACTOR_FLAGS...]
#
# Actor i is named NAME-i (default: this host's name), so a restarted actor
# keeps its name and the learner sees a new run of the same actor. An actor
# that exits 0 (training finished) or 2 (refused by the learner: wrong env or
# spec) is not restarted; any other exit is restarted: at once when the
# actor had been up 10 s or more (killed after working: preempted, OOM), and
# after a backoff of 1 s that doubles, up to 30 s, while it keeps dying within
# 10 s of its start (a crash loop). Ctrl-C or SIGTERM stops every actor.
# Exits 0 when all actors finished, 2 if any was refused.
# --status-file: rewritten at every change, one line of key=value pairs:
# state (running, finished, refused, stopped), actors, alive, restarts,
# finished, refused, pid, updated (epoch seconds); launch_fleet.sh reads it.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}" >&2
  exit 2
}
fail() { echo "launch_actors: $*" >&2; echo >&2; usage; }

learner="" num_actors="" env="atari:Pong" num_envs=8 prefix=$(hostname) log_dir="" status_file=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --learner) learner=${2:-}; shift 2 || fail "--learner needs a value" ;;
    --num-actors) num_actors=${2:-}; shift 2 || fail "--num-actors needs a value" ;;
    --env) env=${2:-}; shift 2 || fail "--env needs a value" ;;
    --num-envs) num_envs=${2:-}; shift 2 || fail "--num-envs needs a value" ;;
    --actor-prefix) prefix=${2:-}; shift 2 || fail "--actor-prefix needs a value" ;;
    --log-dir) log_dir=${2:-}; shift 2 || fail "--log-dir needs a value" ;;
    --status-file) status_file=${2:-}; shift 2 || fail "--status-file needs a value" ;;
    -h|--help) usage ;;
    --) shift; extra=("$@"); break ;;
    *) fail "unknown argument '$1'" ;;
  esac
done
[ -n "$learner" ] || fail "--learner HOST:PORT is required"
[[ "$learner" =~ ^(\[[0-9a-fA-F:.]+\]|[^:]+):[0-9]+$ ]] || fail "--learner '$learner' is not HOST:PORT"
[[ "$num_actors" =~ ^[1-9][0-9]*$ ]] || fail "--num-actors must be a positive integer, got '$num_actors'"
[[ "$num_envs" =~ ^[1-9][0-9]*$ ]] || fail "--num-envs must be a positive integer, got '$num_envs'"
[[ "$env" == *:* ]] || fail "--env '$env' is not FAMILY:NAME (for instance atari:Pong)"

if [ -x "$root/.venv/bin/seedrl-actor" ]; then
  actor_cmd="$root/.venv/bin/seedrl-actor"
elif command -v seedrl-actor >/dev/null 2>&1; then
  actor_cmd=$(command -v seedrl-actor)
else
  echo "launch_actors: seedrl-actor not found; run scripts/setup.sh first" >&2
  exit 1
fi
[ -z "$log_dir" ] || mkdir -p "$log_dir"
[ -z "$status_file" ] || mkdir -p "$(dirname "$status_file")"

declare -A pid_of index_of started_at backoff
finished=0 refused=0 restarts=0 stopping=0 sleep_pid=""

write_status() {
  [ -n "$status_file" ] || return 0
  printf 'state=%s actors=%d alive=%d restarts=%d finished=%d refused=%d pid=%d updated=%d\n' \
    "$1" "$num_actors" "${#pid_of[@]}" "$restarts" "$finished" "$refused" $$ "$(date +%s)" \
    >"$status_file.tmp" && mv -f "$status_file.tmp" "$status_file"
}

start_actor() {
  local i=$1 name="$prefix-$1"
  if [ -n "$log_dir" ]; then
    "$actor_cmd" --learner "$learner" --env "$env" --num-envs "$num_envs" \
      --actor-id "$name" "${extra[@]}" >>"$log_dir/actor-$i.log" 2>&1 &
  else
    "$actor_cmd" --learner "$learner" --env "$env" --num-envs "$num_envs" \
      --actor-id "$name" "${extra[@]}" &
  fi
  pid_of[$i]=$!
  index_of[$!]=$i
  started_at[$i]=$SECONDS
}

stop_all() {
  stopping=1
  local pids=("${pid_of[@]}" $sleep_pid)
  [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null
  wait
  pid_of=()
  write_status stopped
  exit 130
}
trap stop_all INT TERM

for ((i = 0; i < num_actors; i++)); do
  start_actor "$i"
  backoff[$i]=1
done
echo "launch_actors: $num_actors actors x $num_envs envs of $env -> $learner" >&2
write_status running

while [ ${#pid_of[@]} -gt 0 ]; do
  wait -n -p done_pid
  status=$?
  [ -n "${done_pid:-}" ] || continue
  i=${index_of[$done_pid]}
  unset "index_of[$done_pid]" "pid_of[$i]"
  [ $stopping -eq 0 ] || continue
  case $status in
    0) finished=$((finished + 1)); write_status running; continue ;;
    2) refused=$((refused + 1)); write_status running
       echo "launch_actors: actor $prefix-$i was refused by the learner; not restarting" >&2; continue ;;
  esac
  restarts=$((restarts + 1))
  write_status running
  # An actor that had been working is restarted at once, and its crash-loop backoff starts
  # over; one that keeps dying soon after its start waits longer each time.
  if (( SECONDS - started_at[$i] >= 10 )); then
    delay=0 backoff[$i]=1
  else
    delay=${backoff[$i]} backoff[$i]=$(( backoff[$i] * 2 > 30 ? 30 : backoff[$i] * 2 ))
  fi
  echo "launch_actors: actor $prefix-$i exited with $status; restarting in $delay s" >&2
  if (( delay > 0 )); then
    sleep "$delay" &
    sleep_pid=$!
    wait $sleep_pid 2>/dev/null
    sleep_pid=""
  fi
  start_actor "$i"
  write_status running
done
if [ $refused -gt 0 ]; then write_status refused; exit 2; fi
write_status finished
exit 0
