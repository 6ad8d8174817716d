#!/usr/bin/env bash
# Trains on this machine: one learner and a fleet of actors, all local.
#
# Usage: scripts/run_local.sh [ENV_ID] [NUM_ACTORS] [ENVS_PER_ACTOR] [-- LEARNER_FLAGS...]
#   ENV_ID          atari:Pong (default), any atari:GAME (42x42 frames; atari:GAME/84x84 for
#                   the DQN size), classic:CartPole-v1, counting:v0,
#                   football:SCENARIO (after scripts/install_football.sh)
#   NUM_ACTORS      actor processes (default 2)
#   ENVS_PER_ACTOR  envs each actor steps in lock step (default 16; either empty: its default)
#   LEARNER_FLAGS   passed to seedrl-learner, e.g. -- --total-env-steps 1000000
# Environment: SEEDRL_PORT (default 8470), SEEDRL_HTTP_PORT (default SEEDRL_PORT+1:
#   the fleet page and /metrics, on 127.0.0.1), SEEDRL_RUN_DIR (default runs/ENV-TIME).
#
# Installs what it needs into .venv on first use. The learner prints progress
# (frames per second, returns) every few seconds and serves a live fleet page
# at http://127.0.0.1:HTTP_PORT/; TensorBoard files, metrics.jsonl and
# checkpoints go to RUN_DIR, actor logs to RUN_DIR/actors/. Ctrl-C or SIGTERM
# stops every process this script started.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}" >&2
  exit 2
}
fail() { echo "run_local: $*" >&2; echo >&2; usage; }

positional=()
learner_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage ;;
    --) shift; learner_flags=("$@"); break ;;
    -*) fail "unknown option '$1' (learner flags go after --)" ;;
    *) positional+=("$1"); shift ;;
  esac
done
[ ${#positional[@]} -le 3 ] || fail "too many arguments: ${positional[*]}"
env=${positional[0]:-atari:Pong}
num_actors=${positional[1]:-2}
envs_per_actor=${positional[2]:-16}
port=${SEEDRL_PORT:-8470}
http_port=${SEEDRL_HTTP_PORT:-$((${port//[^0-9]/0} + 1))}
[[ "$env" == *:* ]] || fail "ENV_ID '$env' is not FAMILY:NAME (for instance atari:Pong)"
[[ "$num_actors" =~ ^[1-9][0-9]*$ ]] || fail "NUM_ACTORS must be a positive integer, got '$num_actors'"
[[ "$envs_per_actor" =~ ^[1-9][0-9]*$ ]] || fail "ENVS_PER_ACTOR must be a positive integer, got '$envs_per_actor'"
[[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || fail "SEEDRL_PORT '$port' is not a port"
[[ "$http_port" =~ ^-?[0-9]+$ ]] && [ "$http_port" -ge -1 ] && [ "$http_port" -le 65535 ] \
  || fail "SEEDRL_HTTP_PORT '$http_port' is not a port (0: any free one, -1: none)"

cd "$root"
"$root/scripts/setup.sh" || { echo "run_local: setup failed" >&2; exit 1; }
run_dir=${SEEDRL_RUN_DIR:-runs/${env//[:\/]/-}-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$run_dir/actors"
echo "run_local: $env, $num_actors actors x $envs_per_actor envs, learner on port $port, run dir $run_dir"
[ "$http_port" -le 0 ] || echo "run_local: fleet page http://127.0.0.1:$http_port/ (Prometheus: /metrics)"

learner_pid="" fleet_pid=""
cleanup() {
  trap - INT TERM EXIT
  [ -z "$fleet_pid" ] || kill -TERM "$fleet_pid" 2>/dev/null
  [ -z "$learner_pid" ] || kill -TERM "$learner_pid" 2>/dev/null
  wait 2>/dev/null
}
on_signal() { echo "run_local: stopping" >&2; cleanup; exit 130; }
trap on_signal INT TERM
trap cleanup EXIT

.venv/bin/seedrl-learner --env "$env" --port "$port" --http-port "$http_port" --run-dir "$run_dir" \
  ${learner_flags[@]+"${learner_flags[@]}"} &
learner_pid=$!
scripts/launch_actors.sh --learner "127.0.0.1:$port" --num-actors "$num_actors" \
  --env "$env" --num-envs "$envs_per_actor" --actor-prefix local --log-dir "$run_dir/actors" &
fleet_pid=$!

wait "$learner_pid"
status=$?
learner_pid=""
echo "run_local: learner exited with $status; metrics in $run_dir/metrics.jsonl"
exit $status
