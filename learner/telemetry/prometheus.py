"""The learner's Prometheus metrics (/metrics): counters read live from the stats, gauges
from the latest logged record."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

if TYPE_CHECKING:
    from learner.telemetry.server import Telemetry

# Prometheus gauges from the latest record: name, help, record field, scale.
RECORD_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("env_frames_per_second", "Env frames per second over the last log interval.", "fps", 1),
    ("env_steps_per_second", "Env (agent) steps per second.", "env_steps_per_s", 1),
    ("updates_per_second", "Gradient updates per second.", "updates_per_s", 1),
    (
        "episode_return",
        "Mean raw return of the last 100 episodes.",
        "episode_return_mean",
        1,
    ),
    (
        "episode_return_clipped",
        "Mean return of the last 100 episodes with rewards scaled and clipped as in training.",
        "episode_return_clipped_mean",
        1,
    ),
    ("episode_length_steps", "Mean length of the last 100 episodes.", "episode_length_mean", 1),
    ("loss", "Total V-trace loss.", "loss", 1),
    ("policy_loss", "Policy-gradient loss.", "policy_loss", 1),
    ("baseline_loss", "Value (baseline) loss.", "baseline_loss", 1),
    (
        "entropy_loss",
        "Entropy loss (minus the bonus times the entropy, plus any shortfall under the floor "
        "times its weight).",
        "entropy_loss",
        1,
    ),
    ("policy_entropy_nats", "Mean entropy of the policy.", "entropy", 1),
    ("gradient_norm", "Global gradient norm before clipping.", "grad_norm", 1),
    ("learning_rate", "Current learning rate.", "learning_rate", 1),
    (
        "explained_variance",
        "1 - Var[targets - values] / Var[targets]: how much of the value targets the "
        "baseline predicts.",
        "explained_variance",
        1,
    ),
    (
        "advantage_std",
        "Standard deviation of the policy gradient's advantages.",
        "advantage_std",
        1,
    ),
    ("value_target_std", "Standard deviation of the V-trace value targets.", "value_target_std", 1),
    ("value_mean", "Mean value of the batch's states.", "value_mean", 1),
    (
        "policy_kl_behaviour",
        "KL(behaviour || learner policy) on the batch's actions: how off-policy it is.",
        "kl_behaviour",
        1,
    ),
    ("policy_kl_update", "KL between the policies before and after an update.", "kl_update", 1),
    ("policy_lag_updates", "Mean updates between acting and learning.", "policy_lag_mean", 1),
    ("policy_lag_max_updates", "Largest policy lag in the interval.", "policy_lag_max", 1),
    ("inference_batch_size_envs", "Mean envs per inference batch.", "inference_batch_mean", 1),
    (
        "inference_latency_seconds",
        "Mean wait from a request's arrival to its actions.",
        "inference_latency_ms",
        1e-3,
    ),
)


def finite(value: Any) -> float | None:
    """`value` as a float, or None when it is missing or not finite."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class PrometheusCollector:
    """/metrics: read at every scrape, from the live stats and the latest record."""

    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry

    def collect(self) -> Iterator[Any]:
        telemetry = self._telemetry
        counters = telemetry.stats.counters()
        frames_per_step = telemetry.run_info["frames_per_step"]
        yield InfoMetricFamily(
            "seedrl_run",
            "The run this learner trains.",
            value={
                key: str(telemetry.run_info[key])
                for key in ("env", "network", "learner_id", "run_dir")
            },
        )
        for name, help_text, value in (
            ("seedrl_env_steps", "Env (agent) steps trained on.", counters["env_steps"]),
            (
                "seedrl_env_frames",
                "Env frames (steps times frame skip).",
                counters["env_steps"] * frames_per_step,
            ),
            ("seedrl_episodes", "Episodes completed.", counters["episodes"]),
            ("seedrl_updates", "Gradient updates applied.", counters["updates"]),
            (
                "seedrl_rejected_streams",
                "Actor streams refused before being served.",
                counters["rejected_streams"],
            ),
            (
                "seedrl_skipped_updates",
                "Updates skipped for a non-finite loss or gradient.",
                counters["skipped_updates"],
            ),
            (
                "seedrl_dropped_unrolls",
                "Partial unrolls dropped because their actor's stream ended.",
                counters["dropped_unrolls"],
            ),
            (
                "seedrl_dropped_transitions",
                "Transitions in those partial unrolls.",
                counters["dropped_transitions"],
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        for name, help_text, value in (
            ("seedrl_connected_actors", "Actor streams connected.", counters["connected_actors"]),
            ("seedrl_connected_envs", "Envs of the connected streams.", counters["connected_envs"]),
            (
                "seedrl_unroll_queue_depth",
                "Unrolls waiting for the trainer.",
                telemetry.queue_depth(),
            ),
            ("seedrl_uptime_seconds", "Seconds since the learner started.", telemetry.uptime_s()),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        errors = CounterMetricFamily(
            "seedrl_stream_errors",
            "Actor streams the learner ended for a fault, by gRPC status code.",
            labels=["code"],
        )
        for code, count in sorted(telemetry.stats.stream_error_counts().items()):
            errors.add_metric([code], count)
        yield errors
        yield CounterMetricFamily(
            "seedrl_telemetry_cpu_seconds",
            "CPU time spent on TensorBoard, the fleet page and these metrics.",
            value=telemetry.cpu_seconds,
        )
        record = telemetry.latest or {}
        for name, help_text, field, scale in RECORD_GAUGES:
            value = finite(record.get(field))
            if value is not None:
                yield GaugeMetricFamily(f"seedrl_{name}", help_text, value=value * scale)
        busy = GaugeMetricFamily(
            "seedrl_thread_time_ratio",
            "Share of the last log interval each learner thread spent on each activity.",
            labels=["activity"],
        )
        for activity in ("inference", "inference_blocked", "trainer_waiting", "training"):
            value = finite(record.get(f"time_{activity}"))
            if value is not None:
                busy.add_metric([activity], value)
        yield busy
