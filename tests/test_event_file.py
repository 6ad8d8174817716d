"""The learner's own TensorBoard event files, read back with TensorBoard's reader."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    masked_crc32c as tensorboard_masked_crc32c,
)

from learner.telemetry.event_file import (
    FILE_VERSION,
    EventFileWriter,
    crc32c,
    event,
    masked_crc32c,
    scalar_summary,
)
from learner.telemetry.server import Telemetry
from learner.telemetry.stats import LearnerStats
from tests.fleet import ROOT


def read(log_dir) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def test_crc32c_matches_the_standard_and_tensorboards_own():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(0)
    for size in (0, 1, 8, 57, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tensorboard_masked_crc32c(data)


def test_scalars_read_back_with_steps_times_and_float32_values(tmp_path):
    writer = EventFileWriter(str(tmp_path))
    for step in range(4):
        writer.add_scalars(
            {"throughput/fps": 1000.5 + step, "loss/policy": -0.1 * step},
            step * 3_000_000_000,  # past 32 bits, as env frames get
            wall_time=1_700_000_000.25 + step,
        )
    size = os.path.getsize(writer.path)
    writer.add_scalars({}, 99, 0.0)  # nothing to write: no event
    assert os.path.getsize(writer.path) == size
    writer.close()

    events = read(tmp_path)
    assert set(events.Tags()["scalars"]) == {"throughput/fps", "loss/policy"}
    fps = events.Scalars("throughput/fps")
    assert [event.step for event in fps] == [0, 3_000_000_000, 6_000_000_000, 9_000_000_000]
    assert [event.wall_time for event in fps] == [1_700_000_000.25 + step for step in range(4)]
    assert [event.value for event in fps] == [1000.5, 1001.5, 1002.5, 1003.5]
    policy = [event.value for event in events.Scalars("loss/policy")]
    assert policy == [float(np.float32(-0.1 * step)) for step in range(4)]


def test_events_parse_with_tensorboards_own_protos():
    from tensorboard.compat.proto import event_pb2

    start = event_pb2.Event.FromString(event(5.5, -(1 << 63), session_start=True))
    assert start.step == -(1 << 63) and start.session_log.status == event_pb2.SessionLog.START
    header = event_pb2.Event.FromString(event(1.0, 0, file_version=FILE_VERSION))
    assert header.file_version == "brain.Event:2" and header.step == 0
    values = {"ü/ß 中": 1e39, "loss/policy": -0.5, "fps": 7.0}
    scalars = event_pb2.Event.FromString(event(2.0, (1 << 63) - 1, summary=scalar_summary(values)))
    assert scalars.wall_time == 2.0 and scalars.step == (1 << 63) - 1
    assert [(value.tag, value.simple_value) for value in scalars.summary.value] == [
        ("ü/ß 中", float("inf")),  # past float32's range
        ("loss/policy", -0.5),
        ("fps", 7.0),
    ]
    with pytest.raises(ValueError, match="int64"):
        event(0.0, 1 << 63)


def test_a_resumed_run_replaces_what_the_first_wrote_from_its_checkpoint_on(tmp_path):
    first = EventFileWriter(str(tmp_path))
    for step in range(6):
        first.add_scalars({"episode/return": float(step)}, step, wall_time=100.0 + step)
    first.close()
    # The learner died after step 5 and resumes from a checkpoint at step 3.
    resumed = EventFileWriter(str(tmp_path), purge_step=3)
    assert resumed.path != first.path and sorted([first.path, resumed.path])[-1] == resumed.path
    for step in range(3, 6):
        resumed.add_scalars({"episode/return": 100.0 + step}, step, wall_time=200.0 + step)
    resumed.close()

    curve = read(tmp_path).Scalars("episode/return")
    assert [(event.step, event.value) for event in curve] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 103.0),
        (4, 104.0),
        (5, 105.0),
    ]


def test_a_failed_write_is_logged_and_ends_the_file_not_the_caller(tmp_path, caplog):
    writer = EventFileWriter(str(tmp_path))
    writer.add_scalars({"a": 1.0}, 1, wall_time=1.0)
    # The disk fills up: the file's descriptor now points at /dev/full.
    (descriptor,) = [
        int(fd)
        for fd in os.listdir("/proc/self/fd")
        if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(writer.path)
    ]
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, descriptor)
    os.close(full)
    with caplog.at_level(logging.ERROR, logger="learner.telemetry.event_file"):
        writer.add_scalars({"a": 2.0}, 2, wall_time=2.0)
        writer.add_scalars({"a": 3.0}, 3, wall_time=3.0)
    assert writer.closed
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "TensorBoard gets no more" in errors[0].getMessage()
    writer.close()  # again: nothing happens


def telemetry(run_dir, resume_frames=None) -> Telemetry:
    return Telemetry(
        str(run_dir),
        LearnerStats(),
        {},
        lambda: 0,
        {},
        tensorboard=True,
        http_address="127.0.0.1",
        http_port=-1,
        resume_frames=resume_frames,
    )


def publish(target: Telemetry, frames: int, episode_return: float) -> None:
    target.publish(
        {
            "time": 1000.0 + frames,
            "elapsed_s": float(frames),
            "env_frames": frames,
            "fps": 1.0,
            "episode_return_mean": episode_return,
        }
    )


def test_a_resumed_learners_telemetry_marks_its_checkpoint(tmp_path):
    first = telemetry(tmp_path)
    first.start()
    for frames in range(0, 600, 100):
        publish(first, frames, float(frames))
    first.close()
    resumed = telemetry(tmp_path, resume_frames=300)
    resumed.start()
    for frames in range(300, 600, 100):
        publish(resumed, frames, -float(frames))
    resumed.close()

    curve = read(tmp_path / "tensorboard").Scalars("episode/return")
    assert [(point.step, point.value) for point in curve] == [
        (0, 0.0),
        (100, 100.0),
        (200, 200.0),
        (300, -300.0),
        (400, -400.0),
        (500, -500.0),
    ]


def test_telemetry_goes_on_without_tensorboard_where_it_cannot_write(tmp_path, caplog):
    (tmp_path / "tensorboard").write_text("a file where the directory should be")
    target = telemetry(tmp_path)
    with caplog.at_level(logging.ERROR, logger="learner.telemetry.server"):
        target.start()
    assert any("cannot write TensorBoard" in record.getMessage() for record in caplog.records)
    publish(target, 100, 1.0)
    assert target.latest["env_frames"] == 100  # the page's data still flows
    target.close()


def test_the_learners_telemetry_does_not_import_torch(tmp_path):
    """With PyTorch installed beside seedrl (a stand-in package here), writing TensorBoard
    files must not load it: tensorboardX did, at 1-1.8 s and about 200 MB per learner."""
    stand_in = tmp_path / "site" / "torch"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("Tensor = object\n")
    code = f"""
import sys
from learner.telemetry.stats import LearnerStats
from learner.telemetry.server import Telemetry
telemetry = Telemetry({str(tmp_path)!r}, LearnerStats(), {{}}, lambda: 0, {{}}, tensorboard=True,
                      http_address="127.0.0.1", http_port=-1)
telemetry.start()
telemetry.publish({{"time": 1.0, "elapsed_s": 1.0, "env_frames": 10, "fps": 5.0,
                   "episode_return_mean": 1.0}})
telemetry.close()
loaded = "torch" in sys.modules
import torch  # the stand-in is what `import torch` finds: the check above could fail
print(loaded, torch.__file__.startswith({str(stand_in)!r}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"]
    assert read(tmp_path / "tensorboard").Scalars("throughput/env_frames_per_s")[0].value == 5.0
