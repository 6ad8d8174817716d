"""Faults with real processes: resume from checkpoints, learners killed, actors killed.

Short by default (CI). SEEDRL_FAULTS_LONG=1 runs the long forms the
acceptance figures come from: an actor killed every 10 s for 5 minutes.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import jax
import numpy as np

from learner.training import checkpoint
from tests.fleet import (
    ROOT,
    LearnerThread,
    LoggedProcess,
    free_port,
    learner_argv,
    learner_config,
    processes_matching,
    spawn_actor,
    wait_until,
)
from tests.test_integration import Collector, check_unroll
from tests.test_learning import read_metrics

LONG = bool(os.environ.get("SEEDRL_FAULTS_LONG"))
CARTPOLE = "classic:CartPole-v1"


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


# -- resume ------------------------------------------------------------------


def test_a_restarted_learner_resumes_its_checkpoint(tmp_path):
    config = learner_config(
        CARTPOLE, tmp_path / "run", port=free_port(), checkpoint_interval_s=3600
    )
    first = LearnerThread(config).start()
    actor = spawn_actor(first.address, CARTPOLE, 8, "a", tmp_path / "actors")
    try:
        wait_until(lambda: first.learner.stats.updates >= 20, 120, "20 updates")
        first.stop()  # a clean stop writes a checkpoint
        assert first.wait(60) == 0
        saved = first.learner.trainer.state
        counters = first.learner.stats.counters()
        key = jax.random.key_data(first.learner.inference.rng_key)

        second = LearnerThread(config).start()
        learner = second.learner
        assert learner.resumed_from == int(saved.updates)
        assert learner.stats.counters()["env_steps"] == counters["env_steps"]
        assert learner.stats.counters()["updates"] == int(saved.updates)
        assert learner.parameters.latest()[1] == int(saved.updates)
        for got, want in zip(leaves(learner.trainer.state), leaves(saved), strict=True):
            np.testing.assert_array_equal(got, want)
        # Sampling continues from the saved key, not from the seed's.
        assert np.array_equal(np.asarray(jax.random.key_data(learner._policy_key)), key)
        # The actor finds the new learner by itself and training goes on from there.
        wait_until(lambda: learner.stats.updates >= int(saved.updates) + 10, 120, "more updates")
        second.stop()
        assert second.wait(60) == 0
    finally:
        actor.kill()
    records = read_metrics(tmp_path)
    # No record counted the restored steps as new: fps stays physical across the restart.
    assert all((r["fps"] or 0) < 1e6 for r in records)


def test_init_checkpoint_starts_a_new_run_from_saved_parameters(tmp_path):
    config = learner_config(CARTPOLE, tmp_path / "old", checkpoint_interval_s=3600)
    old = LearnerThread(config).start()
    actor = spawn_actor(old.address, CARTPOLE, 8, "a", tmp_path / "actors")
    try:
        wait_until(lambda: old.learner.stats.updates >= 10, 120, "10 updates")
        old.stop()
        assert old.wait(60) == 0
    finally:
        actor.kill()
    (updates,) = checkpoint.available(str(tmp_path / "old"))
    fresh = learner_config(
        CARTPOLE,
        tmp_path / "new",
        init_checkpoint=str(tmp_path / "old" / "checkpoints" / str(updates)),
    )
    from learner.learner import Learner

    learner = Learner(fresh)
    assert learner.resumed_from is None
    assert learner.stats.counters()["env_steps"] == 0 and int(learner.trainer.state.updates) == 0
    for got, want in zip(
        leaves(learner.trainer.state.params), leaves(old.learner.trainer.state.params), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_a_missing_init_checkpoint_is_refused(tmp_path):
    result = subprocess.run(
        learner_argv(CARTPOLE, tmp_path / "run", "--init-checkpoint", str(tmp_path / "nothing")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "--init-checkpoint: no complete checkpoint under" in result.stderr


def test_a_run_resumed_with_another_network_is_refused(tmp_path):
    """A checkpoint of narrower layers than the flags build stops the learner with the
    array and both shapes, where orbax would name neither flag nor run."""
    from learner.agents.networks import make_network

    narrow = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    params = narrow.init(jax.random.key(0), np.zeros((1, 4), np.float32))
    saver = checkpoint.Checkpointer(str(tmp_path / "run"), interval_s=3600, keep=1)
    saver.save(5, params, {}, {"env_steps": 100, "episodes": 1})
    saver.close()
    result = subprocess.run(
        learner_argv(CARTPOLE, tmp_path / "run"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the checkpoint of update 5" in result.stderr
    assert "does not fit the network being built" in result.stderr


# -- the learner killed --------------------------------------------------------


class CliLearner(LoggedProcess):
    """seedrl-learner as users run it, on a fixed port and run directory."""

    def __init__(self, tmp_path, port: int, index: int, *flags: str):
        argv = learner_argv(CARTPOLE, tmp_path / "run", *flags, port=port)
        super().__init__(argv, tmp_path / f"learner-{index}.log")


def _stamp(line: str) -> float:
    clock = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
    return time.mktime(clock) + int(line[20:23]) / 1000


def serving_to_connected_s(log: str, actors: int) -> float:
    """Seconds from 'serving' to the last of `actors` actors connecting, from log times."""
    lines = log.splitlines()
    serving = next(_stamp(line) for line in lines if " serving " in line)
    connected = [_stamp(line) for line in lines if re.search(r"actor \S+ run \S+ connected", line)]
    assert len(connected) >= actors, log[-3000:]
    return sorted(connected)[actors - 1] - serving


def test_learner_killed_ten_times_resumes_every_time_and_still_solves_cartpole(tmp_path):
    port = free_port()
    flags = ("--checkpoint-interval-s", "1", "--stop-at-return", "475")
    kills = 10
    resumed: list[tuple[int, int]] = []  # (updates, env steps) each restart resumed from
    reconnect_s: list[float] = []
    # The actors' default backoff, as users run them; few envs, so that CartPole takes
    # long enough to learn for ten kills to land before it is solved.
    backoff = ("--backoff-initial-s", "0.5", "--backoff-max-s", "8")
    actors = []
    learner = None
    run_dir = str(tmp_path / "run")
    newest = 0
    rng = random.Random(1)
    try:
        for index in range(kills + 1):
            learner = CliLearner(tmp_path, port, index, *flags)
            log = learner.log
            wait_until(lambda log=log: " serving " in log(), 300, "the learner to serve")
            if index:
                match = re.search(r"from its checkpoint of update (\d+) \((\d+) env steps\)", log())
                assert match, log()[-3000:]
                resumed.append((int(match[1]), int(match[2])))
                # The newest complete checkpoint when the last learner died, exactly.
                assert resumed[-1][0] == newest, (resumed[-1], newest)
            else:
                actors = [
                    spawn_actor(
                        f"127.0.0.1:{port}", CARTPOLE, 4, f"cp-{i}", tmp_path / "actors", *backoff
                    )
                    for i in range(2)
                ]
            wait_until(
                lambda log=log: len(re.findall(r"actor \S+ run \S+ connected", log())) >= 2,
                30,
                "both actors to reconnect",
            )
            reconnect_s.append(serving_to_connected_s(log(), 2))
            if index == kills:
                break
            # Train a random stretch (10-80 updates) past the resumed point, up to a
            # complete checkpoint, then kill: the kills land all through the run.
            target = max(checkpoint.available(run_dir), default=0) + rng.randrange(10, 80)
            wait_until(
                lambda target=target: max(checkpoint.available(run_dir), default=0) >= target,
                120,
                f"a complete checkpoint of update {target} or later",
            )
            assert learner.process.poll() is None, f"run {index} ended before its kill"
            learner.kill()
            # Whatever the kill interrupted, every listed checkpoint loads.
            listed = checkpoint.available(run_dir)
            for updates in listed:
                checkpoint.load_params(run_dir, example_params(), updates)
            newest = listed[-1]
        code = learner.process.wait(timeout=900)
        assert code == 0, learner.log()[-3000:]
    finally:
        if learner is not None:
            learner.kill()
        for actor in actors:
            actor.kill()
    steps = [env_steps for _, env_steps in resumed]
    print(
        f"\n{kills} SIGKILLs: resumed from updates {[u for u, _ in resumed]}, env steps {steps}; "
        f"actors reconnected {min(reconnect_s):.1f}-{max(reconnect_s):.1f} s after serving"
    )
    assert len(resumed) == kills and all(updates > 0 for updates, _ in resumed)
    assert steps == sorted(steps), "env step counters went backwards"
    assert max(reconnect_s) <= 10.0, reconnect_s
    final = [r for r in read_metrics(tmp_path) if r["episode_return_mean"] is not None]
    assert final[-1]["episode_return_mean"] >= 475


def checkpoint_lines(log: str) -> list[str]:
    return re.findall(r"checkpoint of update \d+ being written", log)


def example_params():
    """CartPole's network parameters, as the preset builds them (for loading)."""
    from envs import registry
    from learner.agents.networks import make_network
    from learner.presets import preset_for

    config = preset_for(CARTPOLE)
    spec = registry.spec(CARTPOLE)
    network = make_network(config.network, spec.action.num_actions, config.mlp_hidden_sizes)
    return network.init(jax.random.key(0), np.zeros((1, *spec.observation.shape), np.float32))


# -- actors killed ---------------------------------------------------------------


def test_actors_killed_at_random_cost_only_their_own_partial_unrolls(tmp_path):
    """scripts/launch_actors.sh keeps 4 actors up while one is SIGKILLed every period.

    Each victim has been up past the launcher's crash-loop window (10 s), as a preempted
    actor that had been working: the launcher restarts it at once, without a backoff."""
    period_s, duration_s = (10.0, 300.0) if LONG else (5.0, 30.0)
    env = "counting:v0"
    config = learner_config(
        env, tmp_path / "run", unroll_length=5, unroll_queue_size=256, total_env_steps=10**12
    )
    fleet = LearnerThread(config, train=False).start()
    prefix = f"chaos{os.getpid()}"
    collector = Collector(fleet)
    launcher = subprocess.Popen(
        [
            str(ROOT / "scripts" / "launch_actors.sh"),
            "--learner",
            fleet.address,
            "--num-actors",
            "4",
            "--env",
            env,
            "--num-envs",
            "4",
            "--actor-prefix",
            prefix,
            "--log-dir",
            str(tmp_path / "actors"),
        ],
        stdout=open(tmp_path / "launch.log", "w"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    launched = time.monotonic()
    # When each actor's current process started, as this test sees it (its kill, for a
    # replacement); with 2 s of margin over the window for the launcher's whole seconds.
    up_since = {f"{prefix}-{i}": launched for i in range(4)}
    working_s = 12.0
    learner = fleet.learner
    rng = random.Random(0)
    recoveries: list[float] = []
    ratios: list[float] = []  # fleet throughput after / before: reported (machine noise)
    shares: list[float] = []  # the replacement's rate / the other actors' mean: asserted
    try:
        collector.drain_until(lambda: learner.stats.connected_actors == 4, 120, "4 actors")
        started = max(time.monotonic(), launched + working_s)
        for kill in range(int(duration_s / period_s)):
            at = started + kill * period_s
            collector.drain_until(
                lambda at=at: time.monotonic() >= at, period_s + 30, "the next kill"
            )
            # The whole fleet is up before each kill (a replacement may still be starting).
            collector.drain_until(lambda: learner.stats.connected_actors == 4, 60, "4 actors")
            before, _ = rates(collector, learner, 2.0)
            streams = list(learner.service.streams.values())
            now = time.monotonic()
            victim = rng.choice(
                sorted(s.actor_id for s in streams if now - up_since[s.actor_id] >= working_s)
            )
            runs = {s.run_id for s in streams if s.actor_id == victim}
            (pid,) = {s.pid for s in streams if s.actor_id == victim}
            os.kill(pid, signal.SIGKILL)
            killed = up_since[victim] = time.monotonic()

            def replaced(victim: str = victim, runs: set = runs) -> bool:
                return any(
                    s.actor_id == victim and s.run_id not in runs and s.steps > 0
                    for s in list(learner.service.streams.values())
                )

            try:
                collector.drain_until(replaced, 30, f"{victim} to be restarted and served")
            except AssertionError as error:
                table = [
                    (s.actor_id, s.run_id, s.pid, s.steps, round(time.monotonic() - s.last_seen, 1))
                    for s in list(learner.service.streams.values())
                ]
                raise AssertionError(f"{error}; killed pid {pid} of runs {runs}; {table}") from None
            recoveries.append(time.monotonic() - killed)
            after, per_actor = rates(collector, learner, 2.0)
            ratios.append(after / before)
            others = [r for actor, r in per_actor.items() if actor != victim]
            shares.append(per_actor.get(victim, 0.0) / (sum(others) / len(others)))
        assert fleet.wait(0) is None and fleet.exit_code is None, "the learner stopped"
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
        fleet.stop()
    for _, _, unroll in collector.unrolls:
        check_unroll(unroll)  # one env of one run, consecutive steps: nothing mixed
    print(
        f"\n{len(recoveries)} actors killed: replacement served after "
        f"{min(recoveries):.1f}-{max(recoveries):.1f} s and then stepped at "
        f"{min(shares):.2f}-{max(shares):.2f} of the other actors' rate; fleet throughput "
        f"after / before {min(ratios):.2f}-{max(ratios):.2f}; "
        f"{len(collector.unrolls)} unrolls checked"
    )
    # Each had been working, so each came back without a crash loop's backoff.
    restarts = (tmp_path / "launch.log").read_text().count("exited with 137; restarting in 0 s")
    assert restarts == len(recoveries), restarts
    assert max(recoveries) <= 5.0, recoveries
    # Recovered: the fleet is whole and the new actor does its share. (The fleet's total
    # over 2 s windows swings +-25% with this shared machine's noise, so it is reported,
    # not asserted; the actors' rates share that noise, so their ratio does not.)
    assert min(shares) >= 0.5, shares
    assert not processes_matching(prefix)


def rates(collector: Collector, learner, seconds: float) -> tuple[float, dict[str, float]]:
    """Env steps per second served over the next `seconds` (unrolls drained meanwhile):
    in all, and per actor (the streams of its current run)."""

    def per_stream() -> dict[tuple[str, str], int]:
        return {
            (s.actor_id, s.run_id): s.steps * s.num_envs
            for s in list(learner.service.streams.values())
        }

    steps, streams = learner.stats.counters()["env_steps"], per_stream()
    until = time.monotonic() + seconds
    collector.drain_until(lambda: time.monotonic() >= until, seconds + 5, "a rate window")
    total = (learner.stats.counters()["env_steps"] - steps) / seconds
    per_actor: dict[str, float] = {}
    for (actor, run), count in per_stream().items():
        if (actor, run) in streams:  # a stream of the whole window
            per_actor[actor] = (count - streams[(actor, run)]) / seconds
    return total, per_actor


# -- many streams ----------------------------------------------------------------


def test_a_thousand_concurrent_streams_all_make_progress(tmp_path):
    """1,024 streams from client processes held by one learner (the benchmark's client)."""
    from bench import serving

    serving.raise_open_file_limit()
    streams = 4096 if LONG else 1024
    row = serving.measure(streams, 1, warmup_s=2.0, duration_s=5.0, run_dir=str(tmp_path))
    print(
        f"\n{streams} streams: {row['streams_progressing']} progressing, "
        f"{row['actor_steps_per_s']:.0f} steps/s, p99 {row['latency_p99_ms']:.0f} ms, "
        f"connected in {row['connect_s']:.1f} s"
    )
    assert row["streams_progressing"] == streams


# -- non-finite losses -------------------------------------------------------------


def test_a_diverging_run_stops_with_its_last_good_state_checkpointed(tmp_path):
    """A learning rate of 1e38 makes the parameters overflow after one update: every
    later loss is NaN, each is skipped, and the third in a row stops the learner."""
    log = tmp_path / "learner.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            learner_argv(
                CARTPOLE,
                tmp_path / "run",
                "--learning-rate",
                "1e38",
                "--no-learning-rate-decay",
                "--max-nonfinite-updates",
                "3",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        actor = None
        try:
            from tests.fleet import port_from_log

            port = port_from_log(log, timeout_s=300)
            actor = spawn_actor(f"127.0.0.1:{port}", CARTPOLE, 4, "a", tmp_path / "actors")
            assert process.wait(timeout=300) == 1
        finally:
            process.kill()
            if actor is not None:
                actor.kill()
    text = log.read_text()
    assert text.count("skipped: loss nan") == 3, text[-3000:]
    assert "3 updates in a row had a non-finite loss or gradient" in text
    # The checkpoint holds the last state an update left finite.
    (updates,) = checkpoint.available(str(tmp_path / "run"))
    params, meta = checkpoint.load_params(str(tmp_path / "run"), example_params(), updates)
    assert meta["updates"] == updates >= 1
    assert all(np.isfinite(leaf).all() for leaf in leaves(params))
