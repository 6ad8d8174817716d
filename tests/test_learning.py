"""Learning through the real path: CLI learner, actor processes, gRPC on loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.fleet import ROOT, first_solved, port_from_log, spawn_actor

pytestmark = pytest.mark.slow


def run_learner(tmp_path, *flags: str) -> tuple[subprocess.Popen, int]:
    log = tmp_path / "learner.log"
    process = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "seedrl-learner"),
            "--port",
            "0",
            "--http-port",
            "0",
            "--bind-address",
            "127.0.0.1",
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
        ],
        stdout=open(log, "w"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return process, port_from_log(log, timeout_s=300)


def read_metrics(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run_eval(run_dir, *flags: str, timeout_s: float = 600) -> dict:
    """seedrl-eval's result: the JSON object on the last line of its stdout."""
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "seedrl-eval"), "--run-dir", str(run_dir), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "mean" in lines[1] and "std" in lines[1], result.stdout  # the table's header
    return json.loads(lines[-1])


def test_cartpole_is_solved_within_500k_env_steps(tmp_path):
    learner, port = run_learner(
        tmp_path,
        "--env",
        "classic:CartPole-v1",
        "--total-env-steps",
        "500000",
        "--stop-at-return",
        "475",
        # ... and only once the policy itself, played greedily by the learner, does too.
        "--stop-eval-episodes",
        "20",
    )
    actors = [
        spawn_actor(f"127.0.0.1:{port}", "classic:CartPole-v1", 16, f"cartpole-{i}", tmp_path)
        for i in range(2)
    ]
    try:
        assert learner.wait(timeout=1200) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        # The learner ended the streams with OK: every actor exits 0 by itself.
        assert [actor.wait(timeout_s=60) for actor in actors] == [0, 0]
    finally:
        learner.kill()
        for actor in actors:
            actor.kill()
    solved = first_solved(tmp_path / "run", 475)
    assert solved["env_steps"] <= 500_000
    # The learner's own greedy check passed before it stopped; the last record has it too.
    log = (tmp_path / "learner.log").read_text()
    check = re.search(
        r"20 greedy episodes of the parameters of update (\d+) averaged ([\d.]+): "
        r"training finished",
        log,
    )
    assert check and float(check.group(2)) >= 475, log[-3000:]
    final = read_metrics(tmp_path)[-1]
    assert final["stop_check_return"] is not None
    short = len(re.findall(r"averaged [\d.]+, short of 475: training on$", log, re.MULTILINE))
    print(
        f"\nCartPole solved at {solved['env_steps']} env steps "
        f"({solved['elapsed_s']:.0f} s, mean return {solved['episode_return_mean']}); "
        f"stopped at {final['env_steps']}, update {check.group(1)}, after the learner's "
        f"greedy check ({check.group(2)}; {short} checks fell short before)"
    )

    # TensorBoard's own reader lists the run's figures.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_telemetry import REQUIRED_TAGS

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) >= REQUIRED_TAGS
    assert max(e.value for e in events.Scalars("episode/return")) >= 475

    # The saved agent, played greedily by seedrl-eval, holds the pole.
    result = run_eval(tmp_path / "run", "--episodes", "20")
    print(f"seedrl-eval: mean {result['mean']} std {result['std']} over 20 episodes")
    assert result["episodes"] == 20 and len(result["returns"]) == 20
    assert result["mean"] >= 450, result
    # ... being the policy the learner's check passed: the run ended with its state.
    assert result["checkpoint_updates"] == int(check.group(1)), result


def test_an_untrained_agent_evaluates_far_lower(tmp_path):
    """A run of a few hundred env steps: its checkpoint plays CartPole badly."""
    learner, port = run_learner(
        tmp_path, "--env", "classic:CartPole-v1", "--total-env-steps", "1000"
    )
    actor = spawn_actor(f"127.0.0.1:{port}", "classic:CartPole-v1", 4, "brief", tmp_path)
    try:
        assert learner.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert actor.wait(timeout_s=60) == 0
    finally:
        learner.kill()
        actor.kill()
    result = run_eval(tmp_path / "run", "--episodes", "20", "--sample")
    assert result["policy"] == "sample" and result["episodes"] == 20
    assert result["checkpoint_env_steps"] <= 2000
    print(f"\nuntrained CartPole: mean {result['mean']} over 20 episodes")
    assert result["mean"] < 100, result


def test_pong_trains_through_the_real_path(tmp_path):
    """A short Pong run with the Atari preset: frames flow, updates happen, exit is clean."""
    learner, port = run_learner(
        tmp_path,
        "--env",
        "atari:Pong",
        "--total-env-steps",
        "1200",
        "--unroll-length",
        "5",
        "--batch-size",
        "8",
        "--unroll-queue-size",
        "8",
        "--inference-batch-size",
        "8",
        "--log-interval-s",
        "1",
    )
    actor = spawn_actor(f"127.0.0.1:{port}", "atari:Pong", 4, "pong", tmp_path)
    try:
        assert learner.wait(timeout=600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert actor.wait(timeout_s=60) == 0
    finally:
        learner.kill()
        actor.kill()
    records = read_metrics(tmp_path)
    final = records[-1]
    assert final["env_steps"] >= 1200
    assert final["env_frames"] == 4 * final["env_steps"]  # frame skip 4
    assert final["updates"] >= 10
    assert max(r["fps"] or 0 for r in records) > 0
    assert any(r["inference_batch_mean"] for r in records)

    # seedrl-eval plays the saved agent and films its first game.
    import imageio_ffmpeg

    video = tmp_path / "pong.mp4"
    result = run_eval(tmp_path / "run", "--episodes", "1", "--video", str(video))
    assert result["episodes"] == 1 and -21 <= result["mean"] <= 21
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert frames == result["lengths"][0] + 1  # the first observation and one per step
