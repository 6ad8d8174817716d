"""The log record and the console's progress line."""

from __future__ import annotations

import json

import pytest

from learner.telemetry.metrics import MetricsLogger, format_duration
from learner.telemetry.stats import LearnerStats


@pytest.mark.parametrize(
    ("seconds", "text"), [(7, "7s"), (95, "1m35s"), (3725, "1h02m"), (0.4, "0s")]
)
def test_durations_read_compactly(seconds, text):
    assert format_duration(seconds) == text


def test_record_and_console_line(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("learner.telemetry.metrics.time.time", lambda: clock[0])
    stats = LearnerStats()
    logger = MetricsLogger(
        str(tmp_path / "metrics.jsonl"), stats, frames_per_step=4, total_env_steps=10_000
    )
    stats.add_episodes([21.0, -3.0], [100, 50], env_steps=2_500, clipped_returns=[1.0, -1.0])
    stats.stream_change(actors=2, envs=16)
    clock[0] += 10.0
    record = logger.record(unroll_queue_depth=3)
    logger.write(record)
    logger.close()
    assert record["env_frames"] == 10_000 and record["fps"] == 1_000.0
    assert record["episode_return_mean"] == 9.0
    assert record["episode_return_clipped_mean"] == 0.0
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    line = logger.console_line(record)
    # A quarter done at 250 steps/s: 7,500 steps left, 30 s.
    assert line.startswith("[#####...............]  25.0% eta 30s ")
    assert "fps 1,000" in line and "return 9.00" in line and "actors 2" in line
