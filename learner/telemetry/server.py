"""What users watch while a run goes: TensorBoard, Prometheus /metrics, the fleet page.

Every log interval the learner hands `Telemetry.publish` the record it also
writes to metrics.jsonl; from it come the TensorBoard scalars (x axis: env
frames) and the history behind the page's charts. One HTTP server on its own
threads serves:

- `/`            the live fleet page (learner/telemetry/static/fleet.html, no external assets)
- `/api/status`  the page's data as JSON: the run, the latest record, the
                 history, and the table of connected actors
- `/metrics`     Prometheus text format: counters read live from the learner's
                 stats, gauges from the latest record
- `/healthz`     "ok" while the process answers (liveness)
- `/readyz`      200 while the gRPC server takes actor streams, 503 until
                 it starts and once the learner stops (readiness)

Nothing here runs per actor step: the server's only per-step work is a
stream's step count and last-seen time, which it kept already or is one
clock read. Requests are answered from snapshots, off the event loop.
"""

from __future__ import annotations

import collections
import http.server
import importlib.resources
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from learner.telemetry.event_file import EventFileWriter
from learner.telemetry.prometheus import PrometheusCollector, finite
from learner.telemetry.stats import LearnerStats

logger = logging.getLogger(__name__)

# Record field -> TensorBoard tag. The x axis of every scalar is env frames.
TENSORBOARD_TAGS: dict[str, str] = {
    "fps": "throughput/env_frames_per_s",
    "env_steps_per_s": "throughput/env_steps_per_s",
    "env_steps": "throughput/env_steps",
    "updates_per_s": "throughput/updates_per_s",
    "episode_return_mean": "episode/return",
    "episode_return_clipped_mean": "episode/return_clipped",
    "episode_length_mean": "episode/length",
    "stop_check_return": "episode/stop_check_return",
    "loss": "loss/total",
    "policy_loss": "loss/policy",
    "baseline_loss": "loss/baseline",
    "entropy_loss": "loss/entropy",
    "entropy": "policy/entropy",
    "grad_norm": "optimizer/grad_norm",
    "learning_rate": "optimizer/learning_rate",
    "policy_lag_mean": "policy/lag_mean",
    "policy_lag_max": "policy/lag_max",
    "rho_mean": "policy/rho_mean",
    "kl_behaviour": "policy/kl_behaviour",
    "kl_update": "policy/kl_update",
    "explained_variance": "learning/explained_variance",
    "advantage_std": "learning/advantage_std",
    "value_target_std": "learning/value_target_std",
    "value_mean": "learning/value_mean",
    "inference_batch_mean": "inference/batch_size",
    "inference_latency_ms": "inference/latency_ms",
    "unroll_queue_depth": "learner/unroll_queue_depth",
    "connected_actors": "fleet/connected_actors",
    "connected_envs": "fleet/connected_envs",
    "time_inference": "learner_time/inference",
    "time_inference_blocked": "learner_time/inference_blocked",
    "time_trainer_waiting": "learner_time/trainer_waiting",
    "time_training": "learner_time/training",
}

HISTORY_POINTS = 2000  # chart points kept; halved (every other one) when full
HISTORY_FIELDS = ("elapsed_s", "env_frames", "fps", "episode_return_mean")  # what the charts draw


def actor_name(stream_actor_id: str) -> str:
    """The actor's id without the group suffix its streams carry ("a-1/0" -> "a-1")."""
    name, _, group = stream_actor_id.rpartition("/")
    return name if name and group.isdigit() else stream_actor_id


class ActorTable:
    """The connected actors, one row per actor process (its streams summed)."""

    RATE_WINDOW_S = 1.0  # shortest interval a steps/s figure is measured over

    def __init__(self, streams: dict):
        self._streams = streams  # the service's live dict: read, never written
        self._lock = threading.Lock()
        self._samples: dict[int, tuple[float, int, float]] = {}  # owner -> (time, steps, rate)

    def rows(self) -> list[dict[str, Any]]:
        # A copy of the values taken in one C call, atomic under the GIL, so the
        # event loop may add and remove streams meanwhile.
        streams = list(self._streams.values())
        now = time.monotonic()
        actors: dict[tuple, dict[str, Any]] = {}
        with self._lock:
            live = set()
            for stream in streams:
                live.add(stream.owner)
                rate = self._rate(stream, now)
                key = (stream.hostname, stream.pid, stream.run_id)
                row = actors.get(key)
                if row is None:
                    row = actors[key] = {
                        "id": actor_name(stream.actor_id),
                        "host": stream.hostname,
                        "peer": stream.peer,
                        "pid": stream.pid,
                        "run_id": stream.run_id,
                        "streams": 0,
                        "envs": 0,
                        "env_steps": 0,
                        "steps_per_s": 0.0,
                        "received_bytes": 0,
                        "bytes_per_env_step": 0.0,
                        "last_seen_s": math.inf,
                        "connected_s": 0.0,
                    }
                row["streams"] += 1
                row["envs"] += stream.num_envs
                row["env_steps"] += stream.steps * stream.num_envs
                row["received_bytes"] += stream.received_bytes
                row["steps_per_s"] += rate * stream.num_envs
                row["last_seen_s"] = min(row["last_seen_s"], now - stream.last_seen)
                row["connected_s"] = max(row["connected_s"], now - stream.connected_at)
            for owner in set(self._samples) - live:
                del self._samples[owner]
        for row in actors.values():
            row["steps_per_s"] = round(row["steps_per_s"], 1)
            # What one env step costs the actor's link: sizes links (docs/fleets.md).
            if row["env_steps"]:
                row["bytes_per_env_step"] = round(row["received_bytes"] / row["env_steps"], 1)
            row["last_seen_s"] = round(row["last_seen_s"], 2)
            row["connected_s"] = round(row["connected_s"], 1)
        return sorted(actors.values(), key=lambda row: (row["id"], row["pid"]))

    def _rate(self, stream: Any, now: float) -> float:
        """Messages per second of one stream, over at least RATE_WINDOW_S."""
        sample = self._samples.get(stream.owner)
        if sample is None:
            elapsed = now - stream.connected_at
            rate = stream.steps / elapsed if elapsed > 0 else 0.0
            self._samples[stream.owner] = (now, stream.steps, rate)
            return rate
        then, steps, rate = sample
        if now - then >= self.RATE_WINDOW_S:
            rate = (stream.steps - steps) / (now - then)
            self._samples[stream.owner] = (now, stream.steps, rate)
        return rate


class Telemetry:
    """TensorBoard writer, chart history, and the HTTP server of one learner."""

    def __init__(
        self,
        run_dir: str,
        stats: LearnerStats,
        streams: dict,
        queue_depth: Callable[[], int],
        run_info: dict[str, Any],
        tensorboard: bool,
        http_address: str,
        http_port: int,
        resume_frames: int | None = None,
    ):
        """`http_port` -1: no HTTP server; 0: any free port. `run_info` names the run
        (env, network, learner_id, run_dir, total_env_steps, frames_per_step).
        `resume_frames`: the env frames of the checkpoint a resumed run starts from;
        TensorBoard then drops what earlier event files hold beyond it."""
        self.run_dir = run_dir
        self.stats = stats
        self.queue_depth = queue_depth
        self.run_info = run_info
        self.latest: dict[str, Any] | None = None
        self.serving = False
        """Set by the learner while its gRPC server takes actor streams."""
        self.actors = ActorTable(streams)
        self._tensorboard = tensorboard
        self._resume_frames = resume_frames
        self._http_address = http_address
        self._http_port = http_port
        self._writer: EventFileWriter | None = None
        self._tensorboard_paused = False
        self._cpu_lock = threading.Lock()
        self._cpu_s = 0.0
        self._server: http.server.ThreadingHTTPServer | None = None
        self._history: collections.deque[dict[str, Any]] = collections.deque()
        self._history_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PrometheusCollector(self))
        self._page = (
            importlib.resources.files("learner.telemetry")
            .joinpath("static/fleet.html")
            .read_bytes()
        )

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Opens the event file and starts serving HTTP; OSError if the port is taken."""
        if self._http_port >= 0:
            handler = type("Handler", (_Handler,), {"telemetry": self})
            host = self._http_address.strip("[]")
            server_class = _IPv6Server if ":" in host else _Server
            self._server = server_class((host, self._http_port), handler)
            threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.5},
                name="http",
                daemon=True,
            ).start()
        if self._tensorboard:
            log_dir = os.path.join(self.run_dir, "tensorboard")
            try:
                self._writer = EventFileWriter(log_dir, purge_step=self._resume_frames)
            except OSError:
                # Training matters more than its charts: on without TensorBoard.
                logger.exception("cannot write TensorBoard event files in %s", log_dir)

    def enable_tensorboard(self, enabled: bool) -> None:
        """Pauses or resumes writing event files (benchmarks compare the two)."""
        self._tensorboard_paused = not enabled

    @property
    def http_port(self) -> int | None:
        return None if self._server is None else self._server.server_address[1]

    @property
    def url(self) -> str | None:
        if self._server is None:
            return None
        host = self._server.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.http_port}/"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def cpu_seconds(self) -> float:
        """CPU time the dashboards have cost this process: publishing and HTTP requests."""
        with self._cpu_lock:
            return self._cpu_s

    def _charge(self, started: float) -> None:
        """Adds the calling thread's CPU time since `started` (a time.thread_time())."""
        spent = time.thread_time() - started
        with self._cpu_lock:
            self._cpu_s += spent

    def uptime_s(self) -> float:
        return time.time() - self.stats.start_time

    # -- per log interval ---------------------------------------------------

    def publish(self, record: dict[str, Any]) -> None:
        """Takes the record of the interval just ended (called by the learner's loop)."""
        started = time.thread_time()
        try:
            self._publish(record)
        finally:
            self._charge(started)

    def _publish(self, record: dict[str, Any]) -> None:
        self.latest = record
        point = {field: record[field] for field in HISTORY_FIELDS}
        with self._history_lock:
            self._history.append(point)
            if len(self._history) > HISTORY_POINTS:
                # Every other point goes: the charts keep the whole run, coarser.
                self._history = collections.deque(list(self._history)[::2])
        if self._writer is not None and not self._tensorboard_paused:
            values = {
                tag: value
                for field, tag in TENSORBOARD_TAGS.items()
                if (value := finite(record.get(field))) is not None
            }
            self._writer.add_scalars(values, int(record["env_frames"]), record["time"])

    # -- HTTP ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._history_lock:
            history = list(self._history)
        return {
            "run": self.run_info,
            "time": time.time(),
            "uptime_s": round(self.uptime_s(), 1),
            "latest": self.latest,
            "history": {field: [point[field] for point in history] for field in HISTORY_FIELDS},
            "actors": self.actors.rows(),
        }

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def page(self) -> bytes:
        return self._page


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _Handler(http.server.BaseHTTPRequestHandler):
    telemetry: Telemetry
    server_version = "seedrl"

    def do_GET(self) -> None:
        started = time.thread_time()
        try:
            self._get()
        finally:
            self.telemetry._charge(started)

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path in ("/", "/index.html"):
                self._reply(200, "text/html; charset=utf-8", self.telemetry.page())
            elif path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, self.telemetry.metrics_text())
            elif path == "/api/status":
                body = json.dumps(self.telemetry.status(), allow_nan=False, default=str)
                self._reply(200, "application/json", body.encode())
            elif path == "/healthz":
                self._reply(200, "text/plain; charset=utf-8", b"ok\n")
            elif path == "/readyz":
                if self.telemetry.serving:
                    self._reply(200, "text/plain; charset=utf-8", b"ready\n")
                else:
                    self._reply(503, "text/plain; charset=utf-8", b"not serving actors\n")
            else:
                self._reply(404, "text/plain; charset=utf-8", f"no page {path}\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http %s: " + format, self.address_string(), *args)
