"""One JSON object per log interval in RUN_DIR/metrics.jsonl, and a console line."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, TextIO

from learner.telemetry.stats import LearnerStats


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    """3725 -> "1h02m", 95 -> "1m35s", 7 -> "7s"."""
    total = round(seconds)
    if total >= 3600:
        return f"{total // 3600}h{total % 3600 // 60:02d}m"
    if total >= 60:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total}s"


def explained_variance_of(
    baseline_error_variance: float | None, value_target_variance: float | None
) -> float | None:
    """1 - Var[v_s - V(x_s)] / Var[v_s] from the two variances, each pooled over the
    interval's updates (agents/vtrace/learning.py, learning_health): how much of the value
    targets' spread the baseline predicts. None while the targets do not vary."""
    if baseline_error_variance is None or not value_target_variance:
        return None
    return 1.0 - baseline_error_variance / value_target_variance


def _sqrt(value: float | None) -> float | None:
    return None if value is None else math.sqrt(value)


class MetricsLogger:
    """Turns LearnerStats snapshots into records: rates, means and time shares."""

    def __init__(self, path: str, stats: LearnerStats, frames_per_step: int, total_env_steps: int):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the run
        self._stats = stats
        self._frames_per_step = frames_per_step
        self._total_env_steps = total_env_steps
        self._last_time = time.time()
        # A resumed run's counters start where its checkpoint left them.
        counters = stats.counters()
        self._last_env_steps = counters["env_steps"]
        self._last_updates = counters["updates"]

    def record(self, unroll_queue_depth: int) -> dict[str, Any]:
        """The figures of the interval since the previous record."""
        now = time.time()
        snapshot = self._stats.snapshot()
        interval = max(now - self._last_time, 1e-9)
        env_steps = snapshot["env_steps"]
        window = snapshot["window"]
        timers = snapshot["timers"]

        def mean(name: str, scale: float = 1.0) -> float | None:
            value = window[name].mean() if name in window else None
            return None if value is None else value * scale

        returns, lengths = snapshot["returns"], snapshot["lengths"]
        clipped = snapshot["clipped_returns"]
        record: dict[str, Any] = {
            "time": round(now, 3),
            "elapsed_s": round(now - self._stats.start_time, 3),
            "env_steps": env_steps,
            "env_frames": env_steps * self._frames_per_step,
            "fps": _round((env_steps - self._last_env_steps) * self._frames_per_step / interval, 1),
            "env_steps_per_s": _round((env_steps - self._last_env_steps) / interval, 1),
            "episodes": snapshot["episodes"],
            "episode_return_mean": _round(sum(returns) / len(returns)) if returns else None,
            "episode_return_clipped_mean": _round(sum(clipped) / len(clipped)) if clipped else None,
            "episode_length_mean": _round(sum(lengths) / len(lengths), 1) if lengths else None,
            "updates": snapshot["updates"],
            "updates_per_s": _round((snapshot["updates"] - self._last_updates) / interval, 3),
            "loss": _round(mean("loss")),
            "policy_loss": _round(mean("policy_loss")),
            "baseline_loss": _round(mean("baseline_loss")),
            "entropy_loss": _round(mean("entropy_loss"), 6),
            "entropy": _round(mean("entropy")),
            "grad_norm": _round(mean("grad_norm")),
            "learning_rate": _round(mean("learning_rate"), 8),
            "rho_mean": _round(mean("rho_mean")),
            # Learning health (agents/vtrace/learning.py, learning_health and update_kl).
            "explained_variance": _round(
                explained_variance_of(
                    mean("baseline_error_variance"), mean("value_target_variance")
                )
            ),
            "advantage_std": _round(_sqrt(mean("advantage_variance")), 6),
            "value_target_std": _round(_sqrt(mean("value_target_variance")), 6),
            "value_mean": _round(mean("value_mean")),
            "kl_behaviour": _round(mean("kl_behaviour"), 6),
            "kl_update": _round(mean("kl_update"), 7),
            "policy_lag_mean": _round(mean("policy_lag"), 2),
            "policy_lag_max": (
                _round(window["policy_lag_max"].maximum, 1) if "policy_lag_max" in window else None
            ),
            "inference_batch_mean": _round(mean("inference_batch_envs"), 2),
            "inference_latency_ms": _round(mean("inference_latency_s", 1000.0), 3),
            # --stop-eval-episodes: the greedy mean of the learner's own check, if one ran.
            "stop_check_return": _round(mean("stop_check_return")),
            "unroll_queue_depth": unroll_queue_depth,
            "connected_actors": snapshot["connected_actors"],
            "connected_envs": snapshot["connected_envs"],
            "rejected_streams": snapshot["rejected_streams"],
            "skipped_updates": snapshot["skipped_updates"],
            "dropped_unrolls": snapshot["dropped_unrolls"],
            "dropped_transitions": snapshot["dropped_transitions"],
            # Shares of the interval: the inference thread computing or blocked on a
            # full unroll queue; the trainer waiting for unrolls or training.
            "time_inference": _round(timers.get("inference", 0.0) / interval, 3),
            "time_inference_blocked": _round(timers.get("inference_blocked", 0.0) / interval, 3),
            "time_trainer_waiting": _round(timers.get("trainer_waiting", 0.0) / interval, 3),
            "time_training": _round(timers.get("training", 0.0) / interval, 3),
        }
        self._last_time = now
        self._last_env_steps = env_steps
        self._last_updates = snapshot["updates"]
        return record

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def console_line(self, record: dict[str, Any]) -> str:
        progress = record["env_steps"] / self._total_env_steps
        bar_width = 20
        filled = min(bar_width, int(progress * bar_width))
        episode_return = record["episode_return_mean"]
        lag = record["policy_lag_mean"]
        rate = record["env_steps_per_s"]
        remaining = max(0, self._total_env_steps - record["env_steps"])
        eta = format_duration(remaining / rate) if rate else "-"
        return (
            f"[{'#' * filled}{'.' * (bar_width - filled)}] {100 * progress:5.1f}% eta {eta} "
            f"steps {record['env_steps']:,} frames {record['env_frames']:,} "
            f"fps {record['fps'] or 0:,.0f} "
            f"return {'-' if episode_return is None else f'{episode_return:.2f}'} "
            f"episodes {record['episodes']} actors {record['connected_actors']} "
            f"batch {record['inference_batch_mean'] or 0:.1f} "
            f"queue {record['unroll_queue_depth']} updates {record['updates']} "
            f"lag {'-' if lag is None else f'{lag:.1f}'} loss {record['loss']} "
            f"entropy {_or_dash(record['entropy'], '.3f')} "
            f"ev {_or_dash(record['explained_variance'], '.2f')}"
        )

    def close(self) -> None:
        self._file.close()
