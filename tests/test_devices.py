"""The learner over several devices and several processes (learner/backends/devices.py).

The update on N forced CPU devices against the same update on one; CartPole
learnt on 2 devices through the real path; two learner processes joined by
jax.distributed training one model, bit-identical on both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from learner.backends.devices import DeviceError, device_indices, distributed_settings
from learner.config import LearnerConfig
from learner.main import parse_cli
from learner.training.settings import (
    global_batch_size,
    learning_rate_schedule,
    scaled_learning_rate,
)
from tests.fleet import (
    ROOT,
    LoggedProcess,
    first_solved,
    free_port,
    learner_argv,
    port_from_log,
    spawn_actor,
    train_to_the_end,
)


def forced_devices(count: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}


# -- configuration ------------------------------------------------------------------


def test_device_counts_parse_and_bad_ones_say_what_is_accepted():
    assert device_indices("1") == [0]
    assert device_indices("4") == [0, 1, 2, 3]
    assert device_indices("all") is None
    assert device_indices("0,2") == [0, 2]
    for bad in ("0", "two", "1,1", "-1,0"):
        with pytest.raises(DeviceError):
            device_indices(bad)
    with pytest.raises(ValueError, match="learner-devices"):
        LearnerConfig(learner_devices="many")


def test_global_batch_and_the_linear_scaling_rule():
    config = LearnerConfig(batch_size=32, learning_rate=4e-4)
    assert global_batch_size(config, 8) == 32  # --batch-size is global
    per_device = LearnerConfig(batch_size_per_device=16, learning_rate=4e-4)
    assert global_batch_size(per_device, 8) == 128
    assert scaled_learning_rate(per_device, 128) == 4e-4  # no base batch: as given
    scaled = LearnerConfig(learning_rate=4e-4, learning_rate_base_batch=32)
    assert scaled_learning_rate(scaled, 128) == pytest.approx(1.6e-3)
    # The schedule starts at the scaled rate and counts updates of the global batch.
    schedule = learning_rate_schedule(scaled, 128)
    assert float(schedule(0)) == pytest.approx(1.6e-3)
    total_updates = scaled.total_env_steps // (scaled.unroll_length * 128)
    assert float(schedule(total_updates)) == pytest.approx(0.0, abs=1e-9)


def test_distributed_settings_from_flags_or_the_environment(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed_settings("", 0, -1) is None
    flags = distributed_settings("10.0.0.1:1234", 2, 1)
    assert (flags.coordinator_address, flags.num_processes, flags.process_id) == (
        "10.0.0.1:1234",
        2,
        1,
    )
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:5555")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    env = distributed_settings("", 0, -1)
    assert (env.coordinator_address, env.num_processes, env.process_id) == ("host0:5555", 4, 3)
    with pytest.raises(DeviceError, match="process id"):
        distributed_settings("host0:5555", 4, 4)
    config = parse_cli(
        ["--env", "counting:v0", "--learner-devices", "all", "--batch-size-per-device", "4"]
    )
    assert (config.learner_devices, config.batch_size_per_device) == ("all", 4)


def test_a_batch_that_does_not_split_over_the_devices_is_refused(tmp_path):
    result = subprocess.run(
        learner_argv(
            "counting:v0", tmp_path / "run", "--learner-devices", "3", "--batch-size", "8"
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not split evenly over 3 learner devices" in result.stderr


# -- the update on several devices ------------------------------------------------------


@pytest.mark.parametrize("network", ["nature_cnn", "mlp", "lstm"])
def test_the_update_on_4_devices_equals_the_update_on_1(network):
    result = subprocess.run(
        [sys.executable, "-m", "tests.multidevice_check", "4", network],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=forced_devices(4),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"\n{network}: {figures}")
    # Each device got its quarter of the batch; the state lives on all four.
    shards = figures["batch_shards_many"]
    assert [device for device, _ in shards] == [f"cpu:{i}" for i in range(4)]
    assert len({size for _, size in shards}) == 1
    assert shards[0][1] * 4 == figures["batch_shards_one"][0][1]
    assert figures["state_devices"] == [1, 4]
    # Each device computed on its own share only: the gradient's all-reduce, no gathers.
    assert figures["collectives"]["all-reduce"] >= 1
    assert figures["collectives"]["all-gather"] == 0
    assert figures["collectives"]["all-to-all"] == 0
    assert figures["updates"] == [1, 1]
    # The same step: the all-reduced gradient, the optimizer's step and the loss.
    assert figures["gradient_relative"] < 1e-5
    assert figures["update_relative"] < 1e-5
    assert figures["loss_relative"] < 1e-5
    # A batch's passes over its minibatches in one call on the 4 devices: the same steps as
    # one by one on one device, on the unrolls minibatch_columns says make each minibatch.
    assert figures["fused_updates"] == [4, 4]
    # Each step's loss against the size of its terms, which may cancel to near zero.
    assert figures["fused_loss_relative"] < 1e-5
    assert figures["fused_relative"] < 1e-4


# -- through the real path -----------------------------------------------------------


def final_parameters(log: str) -> tuple[int, str]:
    match = re.search(r"final parameters: update (\d+), sha256 ([0-9a-f]{64})", log)
    assert match, log[-3000:]
    return int(match.group(1)), match.group(2)


@pytest.mark.slow
def test_cartpole_is_solved_on_2_learner_devices(tmp_path):
    log = train_to_the_end(
        "classic:CartPole-v1",
        tmp_path / "run",
        tmp_path,
        "--learner-devices",
        "2",
        "--total-env-steps",
        "500000",
        "--stop-at-return",
        "475",
    )
    assert "training on 2 cpu device(s)" in log
    solved = first_solved(tmp_path / "run", 475)
    print(f"\nCartPole on 2 devices solved at {solved['env_steps']} env steps")


def test_a_learner_on_4_devices_trains_through_the_real_path(tmp_path):
    """4 devices train; a fifth, of its own, answers the actors."""
    log = train_to_the_end(
        "counting:v0",
        tmp_path / "run",
        tmp_path,
        "--learner-devices",
        "4",
        "--inference-device",
        "4",
        "--total-env-steps",
        "3000",
        actors=1,
        num_envs=8,
        timeout_s=300,
    )
    assert "training on 4 cpu device(s); inference on cpu:4; 8 unrolls per update" in log
    updates, _ = final_parameters(log)
    assert updates >= 20
    assert (tmp_path / "run" / "checkpoints" / str(updates)).is_dir()


@pytest.mark.slow
def test_two_learner_processes_train_one_model_bit_identical(tmp_path):
    """Two learner processes (2 CPU devices each: a mesh of 4) joined by jax.distributed,
    each serving its own actor; one stops at its env-step budget and both stop after the
    same update with the same parameters."""
    coordinator = f"127.0.0.1:{free_port()}"
    learners, actors = [], []
    try:
        for index in range(2):
            learners.append(
                LoggedProcess(
                    learner_argv(
                        "counting:v0",
                        tmp_path / f"run-{index}",
                        "--learner-devices",
                        "2",
                        "--coordinator-address",
                        coordinator,
                        "--num-processes",
                        "2",
                        "--process-id",
                        str(index),
                        "--total-env-steps",
                        "6000",
                    ),
                    tmp_path / f"learner-{index}.log",
                )
            )
        for index, learner in enumerate(learners):
            port = port_from_log(learner.log_path, timeout_s=300)
            # Different data on each process: only the all-reduce keeps them equal.
            actors.append(
                spawn_actor(
                    f"127.0.0.1:{port}", "counting:v0", 4 * (index + 1), f"a{index}", tmp_path
                )
            )
        codes = [learner.wait(timeout_s=600) for learner in learners]
        assert codes == [0, 0], [learner.log()[-3000:] for learner in learners]
        assert [actor.wait(timeout_s=60) for actor in actors] == [0, 0]
    finally:
        for process in [*learners, *actors]:
            process.kill()
    logs = [learner.log() for learner in learners]
    for log in logs:
        assert "training on 4 cpu device(s) over 2 processes" in log
        assert "agreed to stop after update" in log
    (updates_0, digest_0), (updates_1, digest_1) = map(final_parameters, logs)
    print(f"\n2 learner processes: {updates_0} and {updates_1} updates, sha256 {digest_0[:16]}")
    assert updates_0 == updates_1 >= 20
    assert digest_0 == digest_1
    # Only process 0 writes checkpoints: the parameters are the same everywhere.
    assert (tmp_path / "run-0" / "checkpoints").is_dir()
    assert not (tmp_path / "run-1" / "checkpoints").exists()
