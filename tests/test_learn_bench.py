"""The learning benchmark (bench/learn.py): the README's train command to a score.

Two CartPole runs reach their target through the real path (run_local.sh, the
learner, actor processes, the greedy check) and are reported whole, each and
their median; a Pong
run that cannot reach its target is stopped at its time limit, or by the
user's SIGTERM, and still reports its curve; a run whose learner refuses
its flags says so and why.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from bench import learn
from tests.fleet import ROOT, processes_matching, wait_until, written_records

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_learn(out_dir, *args: str, timeout: float) -> tuple[int, str, dict]:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.learn", "--out-dir", str(out_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = json.loads((out_dir / "learn.json").read_text())
    return completed.returncode, completed.stdout + completed.stderr, report


def test_runs_that_reach_their_target_report_minutes_frames_curves_and_median(tmp_path):
    code, output, report = run_learn(
        tmp_path,
        "--games",
        "classic:CartPole-v1",
        "--target",
        "150",
        "--time-limit-min",
        "8",
        "--runs",
        "2",
        # CartPole can reach 150 within seconds of training: a record each half
        # second gives the curve several points however fast it learns.
        "--learner-flags=--log-interval-s=0.5",
        timeout=900,
    )
    assert code == 0, output[-3000:]
    assert [game["run"] for game in report["games"]] == [1, 2]
    for game in report["games"]:
        assert game["reached"], output[-3000:]
        assert game["env_id"] == "classic:CartPole-v1" and game["target"] == 150
        assert 0 < game["minutes_to_target"] <= 8
        assert game["env_frames_to_target"] > 0
        # The learner stopped only once its greedy episodes reached the target too.
        assert game["greedy_check_returns"] and game["greedy_check_returns"][-1] >= 150
        curve = game["curve"]
        assert len(curve) >= 3
        assert [p["env_frames"] for p in curve] == sorted(p["env_frames"] for p in curve)
        assert curve[-1]["minutes"] <= game["minutes_to_target"]
        assert game["learner_settings"]["env"] == "classic:CartPole-v1"
        assert game["learner_settings"]["stop_at_return"] == 150
        # Each run starts from an initialisation of its own.
        assert game["learner_settings"]["seed"] == game["run"] - 1
        # Each run has a directory of its own: the second did not resume the first.
        assert game["learner_settings"]["run_dir"].endswith(
            f"run-classic-CartPole-v1-{game['run']}"
        )
    first, second = report["games"]
    (summary,) = report["summaries"]
    assert summary["runs"] == 2 and summary["reached"] == 2
    assert summary["minutes_to_target"] == [first["minutes_to_target"], second["minutes_to_target"]]
    assert (
        summary["median_minutes_to_target"]
        == (first["minutes_to_target"] + second["minutes_to_target"]) / 2
    )
    assert report["commit"] and report["machine"]["logical_cores"] >= 1
    assert (tmp_path / "learn-classic-CartPole-v1.png").read_bytes()[:8] == PNG_MAGIC
    assert "150 reached in 2 of 2 runs" in output, output[-3000:]


def test_a_seed_in_the_learner_flags_is_every_runs_seed():
    assert learn.run_seed(["--batch-passes", "3"], 1) == ["--batch-passes", "3"]
    assert learn.run_seed(["--batch-passes", "3"], 3) == ["--batch-passes", "3", "--seed", "2"]
    assert learn.run_seed(["--seed", "7"], 2) == ["--seed", "7"]
    assert learn.run_seed(["--seed=7"], 2) == ["--seed=7"]


def test_the_median_of_runs_counts_a_run_short_of_the_target_as_the_longest():
    assert learn.median_reached([40.0, None, 30.0]) == 40.0
    assert learn.median_reached([30.0, None, None]) is None
    assert learn.median_reached([30.0, 50.0]) == 40.0
    assert learn.median_reached([30.0, None]) is None
    assert learn.median_reached([12.5]) == 12.5
    assert learn.median_reached([None]) is None


def _a_run(run: int, returns: list[float], minutes: float) -> dict:
    """A result as run_game reports it, for a game without a target."""
    curve = [
        {
            "minutes": minutes * (i + 1) / len(returns),
            "env_frames": 100_000 * (i + 1),
            "episode_return_mean": value,
            "stop_check_return": None,
            "fps": 6000.0,
        }
        for i, value in enumerate(returns)
    ]
    return {
        "game": "Breakout",
        "run": run,
        "env_id": "atari:Breakout",
        "target": None,
        "reached": False,
        "minutes_to_target": None,
        "env_frames_to_target": None,
        "minutes_run": minutes,
        "final_return_mean": returns[-1],
        "returns_at_minutes": {
            f"{m:g}": learn.return_at(curve, m, minutes) for m in learn.READ_AT_MINUTES
        },
        "random_score": 1.7,
        "human_score": 30.5,
        "curve": curve,
    }


def test_runs_of_a_game_without_a_target_report_the_median_at_each_mark(tmp_path):
    # Three runs of 60 minutes and one cut short at 20: a mark a run did not live to is
    # the median of the runs that did.
    runs = [
        _a_run(1, [2.0, 10.0, 30.0, 80.0], 60.0),
        _a_run(2, [2.0, 12.0, 40.0, 90.0], 60.0),
        _a_run(3, [2.0, 8.0, 20.0, 60.0], 60.0),
        _a_run(4, [2.0, 5.0], 20.0),
    ]
    summary = learn.summarize(runs)
    assert summary["runs"] == 4 and summary["reached"] == 0
    assert summary["median_minutes_to_target"] is None
    assert summary["median_returns_at_minutes"] == {"15": 2.0, "30": 10.0, "60": 80.0}
    line = learn.summary_of_runs(summary)
    assert line == (
        "atari:Breakout: 4 runs; median 100-episode mean at 15 min 2.0, 30 min 10.0, 60 min 80.0"
    )
    learn.plot(runs, str(tmp_path / "learn-Breakout.png"))
    assert (tmp_path / "learn-Breakout.png").read_bytes()[:8] == PNG_MAGIC


def test_runs_below_one_are_refused(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "bench.learn", "--out-dir", str(tmp_path), "--runs", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert "--runs must be 1 or more, not 0" in completed.stderr
    assert not (tmp_path / "learn.json").exists()


def test_a_run_out_of_time_is_stopped_and_still_reports_its_curve(tmp_path):
    code, output, report = run_learn(
        tmp_path,
        "--games",
        "Pong",
        "--time-limit-min",
        "1",
        "--learner-flags=--seed=7 --unroll-queue-size=24",
        timeout=300,
    )
    assert code == 1, output[-3000:]  # Pong's +18 is not reached in a minute
    (game,) = report["games"]
    assert game["env_id"] == "atari:Pong" and game["target"] == 18.0
    assert not game["reached"] and game["minutes_to_target"] is None
    assert 1.0 <= game["minutes_run"] < 3.0
    assert game["curve"] and game["env_frames_run"] > 0
    assert game["random_score"] == learn.REFERENCE_SCORES["Pong"][0]
    assert game["returns_at_minutes"] == {"15": None, "30": None, "60": None}
    # One --learner-flags value carries several flags, split as a shell would.
    settings = game["learner_settings"]
    assert settings["seed"] == 7 and settings["unroll_queue_size"] == 24, settings
    assert (tmp_path / "learn-Pong.png").read_bytes()[:8] == PNG_MAGIC
    # run_local.sh stopped every process it started.
    assert processes_matching(str(tmp_path)) == []


def test_a_benchmark_stopped_by_the_user_stops_its_fleet_and_keeps_the_curve(tmp_path):
    games = ["--games", "Pong", "Breakout", "--time-limit-min", "30"]
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.learn", "--out-dir", str(tmp_path), *games],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run-Pong" / "metrics.jsonl"
    wait_until(
        lambda: len(written_records(metrics)) >= 2 or process.poll() is not None,
        timeout_s=240,
        what="Pong's first metrics records",
    )
    assert process.poll() is None, process.communicate()[0][-3000:]
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output[-3000:]
    report = json.loads((tmp_path / "learn.json").read_text())
    (game,) = report["games"]  # Breakout never started
    assert game["interrupted"] and not game["reached"] and game["exit_code"] is None
    assert len(game["curve"]) >= 2 and game["env_frames_run"] > 0
    assert "stopped by the user after" in output, output[-3000:]
    assert (tmp_path / "learn-Pong.png").read_bytes()[:8] == PNG_MAGIC
    assert processes_matching(str(tmp_path)) == []


def test_a_run_that_fails_says_so_and_shows_why(tmp_path):
    # Pong's preset trains on batches of 16 unrolls: a queue of 8 cannot hold one.
    code, output, report = run_learn(
        tmp_path, "--games", "Pong", "--learner-flags=--unroll-queue-size=8", timeout=120
    )
    assert code == 1
    (game,) = report["games"]
    assert game["exit_code"] not in (0, None) and not game["reached"]
    assert "the run failed (exit" in output, output[-3000:]
    assert "unroll_queue_size (8) must hold" in output, output[-3000:]


def test_returns_are_read_at_the_last_point_before_each_mark():
    points = [
        {"minutes": 1.0, "episode_return_mean": None},
        {"minutes": 14.9, "episode_return_mean": -20.0},
        {"minutes": 15.1, "episode_return_mean": -10.0},
        {"minutes": 29.0, "episode_return_mean": 5.0},
    ]
    assert learn.return_at(points, 15.0, lasted=29.1) == -20.0
    assert learn.return_at(points, 30.0, lasted=29.1) is None  # the run ended before 30
    assert learn.return_at(points, 0.5, lasted=29.1) is None
    # A run cut at its 30-minute limit logs its last point a little before 30.
    assert learn.return_at(points, 30.0, lasted=30.01) == 5.0
    assert learn.human_normalized("Pong", 14.6) == 1.0
    assert learn.human_normalized("Pong", -20.7) == 0.0
