"""TensorBoard event files, Prometheus /metrics and the live fleet page, on a real fleet.

A CartPole learner serves two real actor processes (one with two streams);
the tests read /metrics with prometheus-client's parser, the fleet page in
Debian's headless Chromium, and the event files with TensorBoard's reader.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import types
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from learner.telemetry.server import TENSORBOARD_TAGS, ActorTable, Telemetry, actor_name
from learner.telemetry.stats import LearnerStats
from learner.training import checkpoint
from tests.fleet import (
    ROOT,
    LearnerThread,
    learner_config,
    spawn_actor,
    wait_until,
    written_records,
)

ENV = "classic:CartPole-v1"
ARTIFACTS = pathlib.Path(os.environ.get("SEEDRL_TEST_ARTIFACTS", ROOT / "runs" / "test-artifacts"))

# The figures issue 4 asks for, as TensorBoard tags and as Prometheus samples.
REQUIRED_TAGS = {
    "throughput/env_frames_per_s",
    "throughput/env_steps",
    "episode/return",
    "episode/return_clipped",
    "episode/length",
    "loss/policy",
    "loss/baseline",
    "loss/entropy",
    "optimizer/grad_norm",
    "optimizer/learning_rate",
    "policy/lag_mean",
    "inference/batch_size",
    "inference/latency_ms",
    "learner/unroll_queue_depth",
    "fleet/connected_actors",
    # Learning health: whether an agent learns before its return moves.
    "learning/explained_variance",
    "learning/advantage_std",
    "learning/value_target_std",
    "learning/value_mean",
    "policy/kl_behaviour",
    "policy/kl_update",
}
REQUIRED_SAMPLES = {
    "seedrl_env_steps_total",
    "seedrl_env_frames_total",
    "seedrl_episodes_total",
    "seedrl_updates_total",
    "seedrl_env_frames_per_second",
    "seedrl_episode_return",
    "seedrl_episode_return_clipped",
    "seedrl_episode_length_steps",
    "seedrl_policy_loss",
    "seedrl_baseline_loss",
    "seedrl_entropy_loss",
    "seedrl_gradient_norm",
    "seedrl_learning_rate",
    "seedrl_policy_lag_updates",
    "seedrl_inference_batch_size_envs",
    "seedrl_inference_latency_seconds",
    "seedrl_unroll_queue_depth",
    "seedrl_connected_actors",
    "seedrl_dropped_unrolls_total",
    "seedrl_dropped_transitions_total",
    "seedrl_explained_variance",
    "seedrl_advantage_std",
    "seedrl_value_target_std",
    "seedrl_value_mean",
    "seedrl_policy_kl_behaviour",
    "seedrl_policy_kl_update",
}


def fetch(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


# -- units ---------------------------------------------------------------------


def test_actor_name_drops_only_a_group_suffix():
    assert actor_name("host-12/0") == "host-12"
    assert actor_name("host-12/11") == "host-12"
    assert actor_name("host-12") == "host-12"
    assert actor_name("team/alice") == "team/alice"
    assert actor_name("/3") == "/3"


def fake_stream(owner, actor_id, pid, num_envs, steps, connected_at, last_seen):
    return types.SimpleNamespace(
        owner=owner,
        actor_id=actor_id,
        hostname="box",
        pid=pid,
        run_id=f"run-{pid}",
        peer=f"ipv4:10.0.0.1:{owner}",
        num_envs=num_envs,
        steps=steps,
        received_bytes=steps * num_envs * 100,
        connected_at=connected_at,
        last_seen=last_seen,
    )


def test_actor_table_sums_an_actors_streams_and_measures_its_rate(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("learner.telemetry.server.time.monotonic", lambda: clock[0])
    streams = {
        1: fake_stream(1, "a/0", 7, 4, steps=50, connected_at=90.0, last_seen=99.5),
        2: fake_stream(2, "a/1", 7, 4, steps=50, connected_at=90.0, last_seen=98.0),
        3: fake_stream(3, "b", 8, 2, steps=10, connected_at=95.0, last_seen=99.0),
    }
    table = ActorTable(streams)
    first = {row["id"]: row for row in table.rows()}
    assert set(first) == {"a", "b"}
    assert first["a"]["streams"] == 2 and first["a"]["envs"] == 8
    assert first["a"]["env_steps"] == 2 * 50 * 4
    assert first["a"]["received_bytes"] == 2 * 50 * 4 * 100
    assert first["a"]["bytes_per_env_step"] == pytest.approx(100)
    # Before a second sample: the rate since connecting (50 messages in 10 s, 4 envs).
    assert first["a"]["steps_per_s"] == pytest.approx(2 * 5 * 4)
    assert first["a"]["last_seen_s"] == pytest.approx(0.5)
    assert first["b"]["steps_per_s"] == pytest.approx(2 / 5 * 10)
    clock[0] = 102.0
    streams[1].steps += 40  # 20 messages/s on one stream, none on the other
    del streams[3]
    second = {row["id"]: row for row in table.rows()}
    assert set(second) == {"a"}
    assert second["a"]["steps_per_s"] == pytest.approx(20 * 4)


def offline_telemetry(run_dir: pathlib.Path, tensorboard: bool, http_port: int = -1) -> Telemetry:
    """A learner's telemetry with no learner (and by default no HTTP server)."""
    return Telemetry(
        str(run_dir),
        LearnerStats(),
        {},
        lambda: 0,
        {"frames_per_step": 1},
        tensorboard=tensorboard,
        http_address="127.0.0.1",
        http_port=http_port,
    )


def test_readiness_follows_the_learners_serving(tmp_path):
    telemetry = offline_telemetry(tmp_path, tensorboard=False, http_port=0)
    telemetry.start()
    try:
        # The gRPC server not started yet: alive but not ready.
        assert fetch(telemetry.url + "healthz")[0] == 200
        assert fetch(telemetry.url + "readyz")[0] == 503
        telemetry.serving = True
        assert fetch(telemetry.url + "readyz")[::2] == (200, b"ready\n")
        telemetry.serving = False  # stopping
        assert fetch(telemetry.url + "readyz")[0] == 503
    finally:
        telemetry.close()


def test_chart_history_keeps_the_whole_run_when_thinned(tmp_path, monkeypatch):
    monkeypatch.setattr("learner.telemetry.server.HISTORY_POINTS", 10)
    telemetry = offline_telemetry(tmp_path, tensorboard=False)
    for index in range(25):
        telemetry.publish(
            {
                "time": float(index),
                "elapsed_s": float(index),
                "env_frames": 100 * index,
                "fps": 1.0,
                "episode_return_mean": None,
            }
        )
    history = telemetry.status()["history"]
    assert len(history["elapsed_s"]) <= 10
    assert history["elapsed_s"][0] == 0.0 and history["elapsed_s"][-1] >= 20.0
    assert history["elapsed_s"] == sorted(history["elapsed_s"])


# -- a real fleet --------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("telemetry")
    config = learner_config(ENV, tmp / "run", log_interval_s=0.5, total_env_steps=10**9)
    learner = LearnerThread(config).start()
    actors = [
        spawn_actor(learner.address, ENV, 8, "cp-0", tmp / "actors"),
        spawn_actor(learner.address, ENV, 8, "cp-1", tmp / "actors", "--groups", "2"),
    ]
    telemetry = learner.learner.telemetry

    def charted() -> bool:
        history = telemetry.status()["history"]
        returns = [value for value in history["episode_return_mean"] if value is not None]
        return len(returns) >= 3 and learner.learner.stats.updates >= 20

    try:
        wait_until(charted, 180, "training with both actors and three chart points")
        yield types.SimpleNamespace(
            learner=learner, url=telemetry.url, tmp=tmp, run_dir=tmp / "run", actors=actors
        )
    finally:
        learner.stop()
        for actor in actors:
            actor.kill()


def test_metrics_parse_with_prometheus_clients_parser(fleet):
    status, content_type, body = fetch(fleet.url + "metrics")
    assert status == 200 and content_type.startswith("text/plain")
    samples = {}
    kinds = {}
    for family in text_string_to_metric_families(body.decode()):
        kinds[family.name] = family.type
        for sample in family.samples:
            samples[sample.name] = sample
    missing = REQUIRED_SAMPLES - set(samples)
    assert not missing, f"missing from /metrics: {sorted(missing)}"
    assert kinds["seedrl_env_steps"] == "counter" and kinds["seedrl_episode_return"] == "gauge"
    assert samples["seedrl_env_steps_total"].value > 0
    # CartPole has no frame skip: frames == steps (read in one scrape).
    assert samples["seedrl_env_frames_total"].value == samples["seedrl_env_steps_total"].value
    assert samples["seedrl_connected_actors"].value == 3  # streams: 1 + 2 groups
    assert samples["seedrl_run_info"].labels["env"] == ENV
    # Counters only grow.
    _, _, later = fetch(fleet.url + "metrics")
    again = {
        s.name: s.value for f in text_string_to_metric_families(later.decode()) for s in f.samples
    }
    assert again["seedrl_env_steps_total"] >= samples["seedrl_env_steps_total"].value


HEALTH_FIELDS = (
    "explained_variance",
    "advantage_std",
    "value_target_std",
    "value_mean",
    "kl_behaviour",
    "kl_update",
)


def test_learning_health_figures_reach_metrics_jsonl(fleet):
    records = written_records(fleet.run_dir / "metrics.jsonl")
    trained = [r for r in records if r["updates"] and r["loss"] is not None]
    assert trained, "no record of an interval with updates"
    for field in HEALTH_FIELDS:
        values = [r[field] for r in trained if r[field] is not None]
        assert values, f"{field} is never set in metrics.jsonl"
    latest = trained[-1]
    # CartPole's targets vary (a reward every step): the baseline explains some of them.
    assert latest["explained_variance"] is not None and latest["explained_variance"] <= 1.0
    assert latest["advantage_std"] > 0 and latest["value_target_std"] > 0
    assert latest["kl_behaviour"] >= 0 and latest["kl_update"] >= 0
    assert any(r["kl_update"] > 0 for r in trained)


def test_status_lists_the_running_actors(fleet):
    status, content_type, body = fetch(fleet.url + "api/status")
    assert status == 200 and content_type == "application/json"
    data = json.loads(body)
    assert data["run"]["env"] == ENV
    rows = {row["id"]: row for row in data["actors"]}
    assert set(rows) == {"cp-0", "cp-1"}
    assert rows["cp-1"]["streams"] == 2 and rows["cp-0"]["streams"] == 1
    assert all(row["envs"] == 8 and row["env_steps"] > 0 for row in rows.values())
    assert all(row["last_seen_s"] < 5 for row in rows.values())
    assert len(data["history"]["fps"]) >= 3


def test_other_paths(fleet):
    assert fetch(fleet.url + "healthz")[:2] == (200, "text/plain; charset=utf-8")
    assert fetch(fleet.url + "readyz")[::2] == (200, b"ready\n")
    status, _, body = fetch(fleet.url + "nothing-here")
    assert status == 404 and b"/nothing-here" in body
    status, content_type, body = fetch(fleet.url)
    assert status == 200 and content_type.startswith("text/html") and b"chart-fps" in body
    # Nothing of the page comes from elsewhere: no external scripts, styles or fonts.
    assert not re.search(rb"(src|href)=[\"']?(https?:)?//", body)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


HEADLESS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def colour_pixels(png: pathlib.Path, rgb: tuple[int, int, int], tolerance: int = 40) -> int:
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB")).astype(np.int32)
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum())


def test_fleet_page_in_a_headless_browser(fleet):
    browser = chromium()
    if browser is None:
        if os.environ.get("SEEDRL_REQUIRE_BROWSER"):
            pytest.fail("SEEDRL_REQUIRE_BROWSER is set but no chromium is installed")
        pytest.skip("no chromium (scripts/test.sh installs Debian's as root)")

    def run(*flags: str, profile: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                browser,
                *HEADLESS,
                f"--user-data-dir={fleet.tmp / profile}",
                "--virtual-time-budget=6000",
                *flags,
                fleet.url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    dom = run("--dump-dom", profile="dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-loaded="true"' in html, html[-2000:]
    points = dict(re.findall(r'id="chart-(fps|return)"[^>]*data-points="(\d+)"', html))
    assert int(points["fps"]) >= 3 and int(points["return"]) >= 3, points
    assert re.search(r'id="chart-fps"[^>]*>.*?<path class="line" d="M[\d.]+ [\d.]+ L', html, re.S)
    assert set(re.findall(r'data-actor="([^"]+)"', html)) == {"cp-0", "cp-1"}

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "fleet-page.png"
    shot.unlink(missing_ok=True)
    result = run("--window-size=1400,1000", f"--screenshot={shot}", profile="shot")
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    print(f"\nscreenshot of the fleet page: {shot}")
    # Both charts drew their lines in their own colours (the page's CSS).
    assert colour_pixels(shot, (0x1F, 0x6F, 0xD1)) > 300, "no FPS line in the screenshot"
    assert colour_pixels(shot, (0xD2, 0x46, 0x2B)) > 300, "no return line in the screenshot"


def test_event_files_and_checkpoint_after_a_clean_stop(fleet):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fleet.learner.stop()
    assert fleet.learner.wait(60) == 0
    updates = fleet.learner.learner.stats.updates

    accumulator = EventAccumulator(str(fleet.run_dir / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    missing = REQUIRED_TAGS - tags
    assert not missing, f"missing from the event files: {sorted(missing)}"
    assert tags <= set(TENSORBOARD_TAGS.values())
    frames = accumulator.Scalars("throughput/env_steps")
    assert len(frames) >= 3 and frames[-1].value > 0
    assert [event.step for event in frames] == sorted(event.step for event in frames)

    # The clean stop saved the final state, which loads into the network's tree.
    assert checkpoint.available(str(fleet.run_dir))[-1] == updates
    params, meta = checkpoint.load_params(
        str(fleet.run_dir), fleet.learner.learner.trainer.state.params
    )
    assert meta["updates"] == updates and meta["env_steps"] > 0
    live = jax.tree.leaves(fleet.learner.learner.trainer.state.params)
    for saved, trained in zip(jax.tree.leaves(params), live, strict=True):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(trained))


def test_dashboard_script_serves_the_runs_event_files(tmp_path):
    """scripts/dashboard.sh starts TensorBoard itself, which lists the run's tags."""
    import signal
    import time

    from tests.fleet import free_port

    telemetry = offline_telemetry(tmp_path, tensorboard=True)
    telemetry.start()
    for index in range(3):
        telemetry.publish(
            {
                "time": 1000.0 + index,
                "elapsed_s": float(index),
                "env_frames": 100 * index,
                "fps": 50.0,
                "episode_return_mean": float(index),
            }
        )
    telemetry.close()
    port = free_port()
    log = open(tmp_path / "dashboard.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [str(ROOT / "scripts" / "dashboard.sh"), str(tmp_path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        tags = None
        while tags is None:
            assert process.poll() is None, (tmp_path / "dashboard.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "TensorBoard did not answer within 180 s"
            try:
                status, _, body = fetch(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
                if status == 200:
                    tags = json.loads(body)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        (run_tags,) = tags.values()
        assert {"throughput/env_frames_per_s", "episode/return"} <= set(run_tags)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()


def test_dashboard_script_needs_a_run_dir():
    result = subprocess.run(
        [str(ROOT / "scripts" / "dashboard.sh"), "/nonexistent"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "usage" in result.stderr
