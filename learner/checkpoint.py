"""Checkpoints of the training state under RUN_DIR/checkpoints, with orbax.

Each checkpoint is a directory named by the update count, holding the
parameters, the optimizer state and a JSON record of the counters (env steps,
frames, updates, time). orbax writes a checkpoint to a temporary directory and
renames it when complete, so a crash mid-save never leaves a checkpoint that
looks whole; it keeps the newest `keep` and deletes older ones.

The trainer saves every `interval_s` seconds between updates, and the learner
once more at a clean stop. Saving is asynchronous: the arrays are copied to
host memory at once and written by a background thread while training goes
on. `load_params` is what seedrl-eval uses: parameters only, no optimizer.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.abspath(os.path.join(run_dir, CHECKPOINT_DIR))


class NoCheckpointError(FileNotFoundError):
    """The run directory has no complete checkpoint (or not the one asked for)."""


class Checkpointer:
    """Saves the training state at most every `interval_s`, keeping the newest `keep`."""

    def __init__(self, run_dir: str, interval_s: float, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = checkpoint_dir(run_dir)
        self._interval_s = interval_s
        self._last_save = time.monotonic()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, create=True
            ),
        )

    def due(self) -> bool:
        return time.monotonic() - self._last_save >= self._interval_s

    def save(self, updates: int, params: Any, opt_state: Any, counters: dict[str, Any]) -> bool:
        """Starts saving the state after `updates` updates; False if that one exists."""
        self._last_save = time.monotonic()
        if updates in self._manager.all_steps():
            return False
        ocp = self._ocp
        meta = {**counters, "updates": updates, "time": time.time()}
        items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
        if jax.tree.leaves(opt_state):  # stateless optimizers have nothing to save
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        self._manager.save(updates, args=ocp.args.Composite(**items))
        logger.info("checkpoint of update %d being written to %s", updates, self.directory)
        return True

    def close(self) -> None:
        """Waits for the save in flight to be complete on disk."""
        self._manager.wait_until_finished()
        self._manager.close()


def available(run_dir: str) -> list[int]:
    """Update counts of the complete checkpoints of a run, oldest first."""
    import orbax.checkpoint as ocp

    directory = checkpoint_dir(run_dir)
    if not os.path.isdir(directory):
        return []
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as m:
        return sorted(m.all_steps())


def load_params(run_dir: str, example_params: Any, updates: int | None = None) -> tuple[Any, dict]:
    """The parameters and counters of a checkpoint (the newest when `updates` is None).

    `example_params` gives the tree's structure, shapes and dtypes (for
    instance the network's freshly initialised parameters).
    """
    import orbax.checkpoint as ocp

    steps = available(run_dir)
    if not steps:
        raise NoCheckpointError(f"no complete checkpoint under {checkpoint_dir(run_dir)}")
    if updates is None:
        updates = steps[-1]
    elif updates not in steps:
        raise NoCheckpointError(
            f"no checkpoint of update {updates} under {checkpoint_dir(run_dir)}; "
            f"there are: {', '.join(map(str, steps))}"
        )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, example_params)
    with ocp.CheckpointManager(
        checkpoint_dir(run_dir), options=ocp.CheckpointManagerOptions(create=False)
    ) as manager:
        restored = manager.restore(
            updates,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
    return restored["params"], dict(restored["meta"])
