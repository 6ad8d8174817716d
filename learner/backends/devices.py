"""Where the learner computes: its training devices, on one host or many, and inference's.

One device (the default) is the plain path: the update is jitted as is and
nothing is sharded. With several devices, the training batch is split along
its batch axis (B of the time-major [T+1, B] arrays) over a one-axis mesh
("batch"), the train state is replicated on every device, and the update is
one jitted SPMD program: XLA computes each device's share of the loss and
all-reduces the gradient (NCCL on GPUs, ICI on TPUs, gloo across CPU
processes), so the parameters stay identical on every device. The same code
runs on one CPU, eight GPUs, or several hosts; only the mesh differs.

Several hosts: each learner process calls `initialize_distributed` (flags or
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), serves its own
actors, and contributes its local share of the batch; the mesh spans every
process's training devices, and the update is the same program on all of
them. Inference stays local: each process answers its own actors with its
replica of the parameters, on one device of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

BATCH_AXIS = "batch"


class DeviceError(ValueError):
    """A device setting this machine cannot satisfy, saying what it has."""


def device_indices(spec: str) -> list[int] | None:
    """The local device indices `spec` names ("4" -> [0, 1, 2, 3], "0,2" -> [0, 2]), or
    None for "all"."""
    spec = spec.strip()
    if spec == "all":
        return None
    if "," not in spec:
        try:
            count = int(spec)
        except ValueError:
            raise DeviceError(
                f"--learner-devices {spec!r}: give a count (4), 'all', or local device "
                "indices (0,2)"
            ) from None
        if count < 1:
            raise DeviceError(f"--learner-devices must be at least 1, got {count}")
        return list(range(count))
    try:
        indices = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise DeviceError(f"--learner-devices {spec!r}: indices must be integers") from None
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise DeviceError(f"--learner-devices {spec!r}: give distinct indices >= 0")
    return indices


def prepare_cpu_devices(spec: str, inference_device: int = -1) -> None:
    """Before JAX starts its backend: lets the CPU backend have as many devices as asked.

    On a CPU-only host "--learner-devices 4" then just works (XLA splits the
    host into 4 devices, each with its own threads). Accelerator backends are
    untouched: their devices are what the hardware has. A count the user
    already forced (XLA_FLAGS' --xla_force_host_platform_device_count) wins.
    """
    indices = device_indices(spec)
    wanted = max(max(indices or [0]) + 1, inference_device + 1)
    if wanted <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    from learner.backends.cpu import xla_flags

    if xla_flags.backend_started():
        return  # too late; select_devices says what is missing
    jax.config.update("jax_num_cpu_devices", max(wanted, jax.config.jax_num_cpu_devices))


@dataclass(frozen=True)
class DistributedSettings:
    coordinator_address: str
    num_processes: int
    process_id: int


def distributed_settings(
    coordinator_address: str, num_processes: int, process_id: int
) -> DistributedSettings | None:
    """The multi-host settings from flags, else JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
    and JAX_PROCESS_ID; None for a single learner process."""
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    count = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
    index = process_id if process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
    if not address and count <= 1:
        return None
    if not address or count < 2 or not 0 <= index < count:
        raise DeviceError(
            "a multi-host learner needs a coordinator address, a process count of at least 2 "
            f"and a process id in 0..count-1; got address {address!r}, count {count}, "
            f"id {index} (flags --coordinator-address, --num-processes, --process-id or "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
        )
    return DistributedSettings(address, count, index)


def initialize_distributed(settings: DistributedSettings | None) -> None:
    """Joins the other learner processes (before JAX starts its backend); blocks until all
    have joined. Nothing for a single process."""
    if settings is None:
        return
    logger.info(
        "joining %d learner processes as process %d (coordinator %s)",
        settings.num_processes,
        settings.process_id,
        settings.coordinator_address,
    )
    jax.distributed.initialize(
        settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
    )


def select_devices(spec: str) -> list[jax.Device]:
    """This process's training devices: the first N local ones, all, or those indices."""
    local = jax.local_devices()
    indices = device_indices(spec)
    if indices is None:
        return local
    if max(indices) >= len(local):
        raise DeviceError(
            f"--learner-devices {spec} needs {max(indices) + 1} local devices; this host has "
            f"{len(local)} ({local[0].platform}). On CPU, XLA_FLAGS="
            "--xla_force_host_platform_device_count=N must not set fewer."
        )
    return [local[index] for index in indices]


class Placement:
    """The training devices of every learner process as one mesh, and inference's device."""

    axis_name = BATCH_AXIS
    """The mesh axis the batch is split along, and the update averages over."""

    def __init__(self, local_devices: list[jax.Device], inference_device: jax.Device | None = None):
        self.local_devices = list(local_devices)
        self.process_count = jax.process_count()
        if self.process_count > 1:
            # The same local positions on every process, process by process.
            positions = [jax.local_devices().index(device) for device in self.local_devices]
            devices = []
            for process in range(self.process_count):
                theirs = [d for d in jax.devices() if d.process_index == process]
                devices.extend(theirs[position] for position in positions)
        else:
            devices = self.local_devices
        self.devices = devices
        self.mesh = Mesh(np.array(devices), (BATCH_AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        # Every array of a batch is time-major [T+1, B, ...]: split along B.
        self.batch_sharding = NamedSharding(self.mesh, P(None, BATCH_AXIS))
        self.inference_device = inference_device or self.local_devices[0]

    @property
    def sharded(self) -> bool:
        """Whether the update spans more than one device (the plain path otherwise)."""
        return len(self.devices) > 1

    @property
    def device_count(self) -> int:
        return len(self.devices)

    @property
    def is_primary(self) -> bool:
        """The process that writes what must be written once (checkpoints)."""
        return jax.process_index() == 0

    def describe(self) -> str:
        kinds = sorted({device.platform for device in self.devices})
        text = f"{len(self.devices)} {'/'.join(kinds)} device(s)"
        if self.process_count > 1:
            text += f" over {self.process_count} processes"
        return f"{text}; inference on {self.inference_device}"

    def jit_sharded(self, update: Callable) -> Callable:
        """`update(state, batch) -> (state, metrics)`, written for one device's share of the
        batch and averaging over `axis_name`, jitted as one program over the mesh: the state
        replicated, the batch split along B, the outputs replicated."""
        mapped = jax.shard_map(
            update,
            mesh=self.mesh,
            in_specs=(P(), P(None, BATCH_AXIS)),
            out_specs=(P(), P()),
        )
        return jax.jit(
            mapped,
            in_shardings=(self.replicated, self.batch_sharding),
            out_shardings=(self.replicated, self.replicated),
        )

    def put_state(self, state: Any) -> Any:
        """The train state replicated on every training device (same values everywhere)."""
        if not self.sharded:
            return jax.device_put(state, self.local_devices[0])
        host = jax.device_get(state)
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(
                np.shape(x), self.replicated, lambda index: np.asarray(x)[index]
            ),
            host,
        )

    def put_batch(self, batch: Any) -> Any:
        """This process's share of a batch ([T+1, B_local, ...] arrays) as the global batch."""
        if not self.sharded:
            return batch
        if self.process_count == 1:
            return jax.device_put(batch, self.batch_sharding)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch
        )

    def local_copy(self, tree: Any) -> Any:
        """A replicated tree's values on the inference device (no copy when it trains too)."""
        if not self.sharded:
            if self.inference_device == self.local_devices[0]:
                return tree
            return jax.device_put(tree, self.inference_device)

        def one(x: jax.Array) -> jax.Array:
            for shard in x.addressable_shards:
                if shard.device == self.inference_device:
                    return shard.data
            return jax.device_put(x.addressable_shards[0].data, self.inference_device)

        return jax.tree.map(one, tree)

    def agree_to_stop(self) -> Callable[[bool], bool]:
        """A collective: True on every process once any of them asks to stop.

        Every process must call it once per update, in step with the update
        itself, so they all stop after the same update and none is left
        waiting in an all-reduce for a process that has gone.
        """
        if self.process_count == 1:
            return lambda wants: wants
        sharding = NamedSharding(self.mesh, P(BATCH_AXIS))
        anyone = jax.jit(lambda flags: flags.any(), out_shardings=self.replicated)
        local = len(self.local_devices)

        def agree(wants: bool) -> bool:
            flags = jax.make_array_from_process_local_data(sharding, np.full(local, wants))
            return bool(anyone(flags))

        return agree


def digest(tree: Any) -> str:
    """sha256 of a tree's leaves (bytes, shapes and dtypes), a tree this process holds
    whole (`Placement.local_copy`): equal digests on two processes mean bit-identical
    parameters."""
    hasher = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        value = np.asarray(jax.device_get(leaf))
        hasher.update(str((value.shape, value.dtype.str)).encode())
        hasher.update(np.ascontiguousarray(value).tobytes())
    return hasher.hexdigest()
