#!/usr/bin/env bash
# Starts actors on many hosts: scripts/launch_actors.sh on every host of a
# file, each host's actors supervised there, then a short status of every
# host until the fleet ends; Ctrl-C (or SIGTERM) stops the whole fleet.
#
# Usage: scripts/launch_fleet.sh --hosts FILE --learner HOST:PORT [OPTIONS] [-- ACTOR_FLAGS...]
#        scripts/launch_fleet.sh --hosts FILE --status | --stop [OPTIONS]
#
# FILE: one host per line, "HOST [ACTORS [ENVS]]"; '#' starts a comment.
#   HOST is what the transport reaches (name or user@name for ssh, IPv6 without
#   brackets, ports in ~/.ssh/config; a namespace's name for netns); ACTORS and
#   ENVS override --actors-per-host and --num-envs. Actor i of HOST is named
#   LABEL-i, LABEL being HOST without its user@.
# Options:
#   --actors-per-host N|auto  actors on a host without its own count (auto: one per core)
#   --env ENV_ID              the learner's env (default atari:Pong)
#   --num-envs K              envs per actor (default 8)
#   --transport ssh|netns|local
#                             ssh (default): ssh -o BatchMode=yes [--ssh-options] HOST;
#                             netns: ip netns exec HOST (root; hosts are namespaces);
#                             local: every host on this machine (to try a hosts file)
#   --ssh-options "OPTS"      more ssh options, e.g. "-i ~/.ssh/fleet -p 2222"
#   --remote-dir DIR          the seedrl checkout on the hosts (default: this one's path)
#   --name NAME               the fleet's name (default fleet): its logs and state are
#                             in REMOTE_DIR/runs/fleets/NAME/HOST/ on each host
#   --setup                   run scripts/setup.sh on every host before starting
#   --detach                  start, print one status, and return
#   --status                  print every host's status and exit
#   --stop                    stop the fleet on every host and exit
#   --status-interval-s S     seconds between status reports (default 10)
# A token in SEEDRL_AUTH_TOKEN is passed to every host on stdin, never on a
# command line. TLS files (-- --tls-ca ...) are paths on the hosts.
# Exits 0 when every host's actors finished (the learner ended training), 2
# if the learner refused an actor, 1 if a host failed to start or its
# supervisor died, 130 when stopped (Ctrl-C here, or --stop from elsewhere).
# --status exits the same way for the fleet's state as it is.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}" >&2
  exit 2
}
fail() { echo "launch_fleet: $*" >&2; echo >&2; usage; }

hosts_file="" learner="" per_host=auto env="atari:Pong" num_envs=8 transport=ssh
ssh_options="" remote_dir=$root name=fleet setup=0 mode=run interval=10
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts_file=${2:-}; shift 2 || fail "--hosts needs a value" ;;
    --learner) learner=${2:-}; shift 2 || fail "--learner needs a value" ;;
    --actors-per-host) per_host=${2:-}; shift 2 || fail "--actors-per-host needs a value" ;;
    --env) env=${2:-}; shift 2 || fail "--env needs a value" ;;
    --num-envs) num_envs=${2:-}; shift 2 || fail "--num-envs needs a value" ;;
    --transport) transport=${2:-}; shift 2 || fail "--transport needs a value" ;;
    --ssh-options) ssh_options=${2:-}; shift 2 || fail "--ssh-options needs a value" ;;
    --remote-dir) remote_dir=${2:-}; shift 2 || fail "--remote-dir needs a value" ;;
    --name) name=${2:-}; shift 2 || fail "--name needs a value" ;;
    --setup) setup=1; shift ;;
    --detach) mode=detach; shift ;;
    --status) mode=status; shift ;;
    --stop) mode=stop; shift ;;
    --status-interval-s) interval=${2:-}; shift 2 || fail "--status-interval-s needs a value" ;;
    -h|--help) usage ;;
    --) shift; extra=("$@"); break ;;
    *) fail "unknown argument '$1'" ;;
  esac
done
[ -n "$hosts_file" ] || fail "--hosts FILE is required"
[ -r "$hosts_file" ] || fail "cannot read the hosts file '$hosts_file'"
case "$transport" in ssh|netns|local) ;; *) fail "--transport must be ssh, netns or local" ;; esac
[[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || fail "--name '$name' may hold only letters, digits, . _ -"
[[ "$interval" =~ ^[1-9][0-9]*$ ]] || fail "--status-interval-s must be a positive integer"
count_ok() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
count_ok "$per_host" || [ "$per_host" = auto ] \
  || fail "--actors-per-host must be a positive integer or auto, got '$per_host'"
count_ok "$num_envs" || fail "--num-envs must be a positive integer, got '$num_envs'"
if [[ $mode == run || $mode == detach ]]; then
  [ -n "$learner" ] || fail "--learner HOST:PORT is required"
  [[ "$learner" =~ ^(\[[0-9a-fA-F:.]+\]|[^:]+):[0-9]+$ ]] || fail "--learner '$learner' is not HOST:PORT"
  [[ "$env" == *:* ]] || fail "--env '$env' is not FAMILY:NAME (for instance atari:Pong)"
fi

# A host's name as a directory and actor-name prefix: no user@, nothing odd.
label() { local h=${1#*@}; echo "${h//[^A-Za-z0-9._-]/_}"; }

# The hosts file: HOST [ACTORS [ENVS]] per line.
hosts=() actors_of=() envs_of=()
line_no=0
while IFS= read -r line || [ -n "$line" ]; do
  line_no=$((line_no + 1))
  line=${line%$'\r'}
  line=${line%%#*}
  read -r host actors envs rest <<<"$line"
  [ -n "${host:-}" ] || continue
  [ -z "${rest:-}" ] || fail "$hosts_file:$line_no: more than HOST ACTORS ENVS: '$line'"
  [ -z "${actors:-}" ] || count_ok "$actors" || [ "$actors" = auto ] \
    || fail "$hosts_file:$line_no: ACTORS '$actors' is not a positive integer or auto"
  [ -z "${envs:-}" ] || count_ok "$envs" \
    || fail "$hosts_file:$line_no: ENVS '$envs' is not a positive integer"
  # Hosts share nothing if their labels differ: the label names state and actors.
  for seen in ${hosts[@]+"${hosts[@]}"}; do
    [ "$(label "$seen")" != "$(label "$host")" ] \
      || fail "$hosts_file:$line_no: host '$host' is '$seen' again (both are '$(label "$host")')"
  done
  hosts+=("$host")
  actors_of+=("${actors:-$per_host}")
  envs_of+=("${envs:-$num_envs}")
done <"$hosts_file"
[ ${#hosts[@]} -gt 0 ] || fail "no hosts in '$hosts_file'"

# remote HOST COMMAND_STRING: runs a shell command on HOST; stdin passes through.
remote() {
  local host=$1 command="cd $(printf %q "$remote_dir") && $2"
  case "$transport" in
    # shellcheck disable=SC2086  # the options are words by design
    ssh) ssh -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 \
      -o ServerAliveCountMax=3 $ssh_options -- "$host" "$command" ;;
    netns) ip netns exec "$host" bash -c "$command" ;;
    local) bash -c "$command" ;;
  esac
}

state_dir_of() { echo "runs/fleets/$name/$(label "$1")"; }

# on_every_host FUNCTION [INDEX...]: runs FUNCTION INDEX for the hosts (all by
# default) at once; prints each host's output prefixed by its name; sets `ok`
# and `failed` to the indices that succeeded and failed; returns 1 if any failed.
on_every_host() {
  local fn=$1 i out row
  shift
  local which=("$@")
  [ ${#which[@]} -gt 0 ] || which=("${!hosts[@]}")
  out=$(mktemp -d) || return 1
  declare -A pid_of
  for i in "${which[@]}"; do
    "$fn" "$i" >"$out/$i" 2>&1 &
    pid_of[$i]=$!
  done
  ok=() failed=()
  for i in "${which[@]}"; do
    if wait "${pid_of[$i]}"; then ok+=("$i"); else failed+=("$i"); fi
    while IFS= read -r row || [ -n "$row" ]; do
      printf '%-24s %s\n' "${hosts[$i]}" "$row"
    done <"$out/$i"
  done
  rm -rf "$out"
  [ ${#failed[@]} -eq 0 ]
}

setup_host() { remote "${hosts[$1]}" "scripts/setup.sh"; }

start_host() {
  local i=$1 host=${hosts[$1]} args
  args=(start --state-dir "$(state_dir_of "$host")" --learner "$learner"
    --num-actors "${actors_of[$i]}" --env "$env" --num-envs "${envs_of[$i]}"
    --actor-prefix "$(label "$host")")
  if [ -n "${SEEDRL_AUTH_TOKEN:-}" ]; then
    args+=(--token-stdin)
  fi
  [ ${#extra[@]} -eq 0 ] || args+=(-- "${extra[@]}")
  printf '%s\n' "${SEEDRL_AUTH_TOKEN:-}" \
    | remote "$host" "scripts/fleet_host.sh $(printf '%q ' "${args[@]}")"
}

status_host() {
  local host=${hosts[$1]}
  remote "$host" "scripts/fleet_host.sh status --state-dir $(printf %q "$(state_dir_of "$host")")" \
    </dev/null || echo "unreachable"
}

stop_host() {
  local host=${hosts[$1]}
  remote "$host" "scripts/fleet_host.sh stop --state-dir $(printf %q "$(state_dir_of "$host")")" \
    </dev/null
}

# Prints the status block; sets `live` (hosts still running) and `worst` (exit code).
report() {
  local lines line
  lines=$(on_every_host status_host)
  echo "launch_fleet: $(date +%H:%M:%S) ${#hosts[@]} hosts"
  echo "$lines"
  # An unreachable host may well be running: only final states end the watch.
  live=$(grep -cE ' (running|unreachable)( |$)' <<<"$lines")
  worst=0
  if grep -q ' stopped ' <<<"$lines"; then worst=130; fi
  if grep -qE ' (died|absent|unreachable)( |$)' <<<"$lines"; then worst=1; fi
  if grep -q ' refused ' <<<"$lines"; then worst=2; fi
}

case "$mode" in
status) report; exit "$worst" ;;
stop) on_every_host stop_host && exit 0; exit 1 ;;
esac

if [ $setup -eq 1 ]; then
  echo "launch_fleet: scripts/setup.sh on ${#hosts[@]} hosts"
  on_every_host setup_host || { echo "launch_fleet: setup failed on some hosts" >&2; exit 1; }
fi
echo "launch_fleet: starting ${#hosts[@]} hosts ($transport) -> $learner"
# Ctrl-C while starting: let every start finish, then stop them all, so no
# host is left running unwatched.
interrupted=0
trap 'interrupted=1' INT TERM
on_every_host start_host
started=$?
if [ $interrupted -eq 1 ]; then
  wait
  echo "launch_fleet: interrupted while starting; stopping the fleet" >&2
  on_every_host stop_host
  exit 130
fi
if [ $started -ne 0 ]; then
  # Only what this command started: a fleet already running stays.
  echo "launch_fleet: ${#failed[@]} of ${#hosts[@]} hosts did not start;" \
    "stopping the ${#ok[@]} started here" >&2
  [ ${#ok[@]} -eq 0 ] || on_every_host stop_host "${ok[@]}"
  exit 1
fi
if [ $mode = detach ]; then
  report
  echo "launch_fleet: detached; '--status' reports, '--stop' stops the fleet"
  exit 0
fi

stop_fleet() {
  trap - INT TERM
  echo "launch_fleet: stopping the fleet"
  on_every_host stop_host
  exit 130
}
trap stop_fleet INT TERM
while true; do
  report
  [ "$live" -gt 0 ] || exit "$worst"
  sleep "$interval" &
  wait $!
done
