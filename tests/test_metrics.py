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


def test_explained_variance_pools_the_intervals_updates(tmp_path):
    """A minibatch without a reward has targets that hardly vary, and its own ratio is far
    below 0 however good the baseline; the record weighs each update by its targets'
    spread, as one variance over all their transitions would."""
    stats = LearnerStats()
    logger = MetricsLogger(
        str(tmp_path / "metrics.jsonl"), stats, frames_per_step=4, total_env_steps=10_000
    )
    # A point scored: the baseline misses a fifth of the targets' spread (0.8 on its own).
    stats.add_many(
        {"value_target_variance": 1.0, "baseline_error_variance": 0.2, "advantage_variance": 0.3}
    )
    # No reward: the targets hardly vary and the baseline's small error exceeds them (-2).
    stats.add_many(
        {
            "value_target_variance": 0.001,
            "baseline_error_variance": 0.003,
            "advantage_variance": 0.1,
        }
    )
    record = logger.record(unroll_queue_depth=0)
    assert record["explained_variance"] == pytest.approx(1 - 0.203 / 1.001, abs=1e-4)
    assert record["value_target_std"] == pytest.approx((1.001 / 2) ** 0.5, abs=1e-6)
    assert record["advantage_std"] == pytest.approx(0.2**0.5, abs=1e-6)
    # The next interval, without updates, has no figure.
    assert logger.record(unroll_queue_depth=0)["explained_variance"] is None
    logger.close()
