"""Checkpoints of the training state under RUN_DIR/checkpoints, with orbax.

Each checkpoint is a directory named by the update count, holding the
parameters, the optimizer state and a JSON record of the counters (env steps,
frames, updates, time). orbax writes a checkpoint to a temporary directory and
renames it when complete, so a crash mid-save never leaves a checkpoint that
looks whole; it keeps the newest `keep` and deletes older ones.

Deletion is made atomic too: orbax renames an old checkpoint into
checkpoints/deleted/ (one rename) and the trash is emptied from there. A
plain recursive delete killed halfway leaves a numbered directory with some
of its files, which would be listed and fail to load; the fault tests found
exactly that. `available` also lists only directories that hold orbax's
metadata and every item, so nothing half-present is ever offered.

The trainer saves every `interval_s` seconds between updates, and the learner
once more at a clean stop. Saving is asynchronous: the arrays are copied to
host memory at once and written by a background thread while training goes
on. `load_params` is what seedrl-eval uses: parameters only, no optimizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
TRASH_DIR = "deleted"  # under CHECKPOINT_DIR: old checkpoints renamed here, then removed
REQUIRED = ("_CHECKPOINT_METADATA", "params", "meta")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.abspath(os.path.join(run_dir, CHECKPOINT_DIR))


def this_process_only(ocp: Any) -> Any:
    """orbax's options for a manager used by this process alone: with several learner
    processes (jax.distributed) only process 0 writes, and orbax must not wait at its
    barriers for processes that never call it."""
    index = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


class NoCheckpointError(FileNotFoundError):
    """The run directory has no complete checkpoint (or not the one asked for)."""


class CheckpointMismatch(ValueError):
    """A checkpoint whose arrays do not fit the network and optimizer being built: it came
    from a run with other network settings (--network, --torso-hidden-size, ...)."""


class Checkpointer:
    """Saves the training state at most every `interval_s`, keeping the newest `keep`."""

    def __init__(self, run_dir: str, interval_s: float, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = checkpoint_dir(run_dir)
        self._interval_s = interval_s
        self._last_save = time.monotonic()
        os.makedirs(self.directory, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=True,
                create=False,  # made below: orbax refuses to with active_processes
                # What a crash mid-save left behind (never listed as a checkpoint) goes.
                cleanup_tmp_directories=True,
                todelete_subdir=TRASH_DIR,
                multiprocessing_options=this_process_only(ocp),
            ),
        )
        self._empty_trash()

    def _empty_trash(self) -> None:
        """Removes checkpoints orbax renamed away (a crash here leaves only trash)."""
        shutil.rmtree(os.path.join(self.directory, TRASH_DIR), ignore_errors=True)

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
        self._empty_trash()
        return True

    def discard_after(self, updates: int) -> None:
        """Deletes the checkpoints of later updates than `updates` (once the save in
        flight is complete), each by one rename as orbax deletes."""
        self._manager.wait_until_finished()
        later = [step for step in self._manager.all_steps() if step > updates]
        for step in later:
            self._manager.delete(step)
        self._empty_trash()
        if later:
            logger.info("checkpoints of updates %s after update %d deleted", later, updates)

    def close(self) -> None:
        """Waits for the save in flight to be complete on disk."""
        self._manager.wait_until_finished()
        self._manager.close()


def available(run_dir: str) -> list[int]:
    """Update counts of the complete checkpoints of a run, oldest first.

    Read from the directory itself, not through orbax's manager, so that a
    reader (seedrl-eval, a test) polling a live run never trips over a
    checkpoint being renamed away while it looks.
    """
    directory = checkpoint_dir(run_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        int(name)
        for name in names
        if name.isdigit()
        and all(os.path.exists(os.path.join(directory, name, item)) for item in REQUIRED)
    )


def _choose(run_dir: str, updates: int | None) -> int:
    steps = available(run_dir)
    if not steps:
        raise NoCheckpointError(f"no complete checkpoint under {checkpoint_dir(run_dir)}")
    if updates is None:
        return steps[-1]
    if updates not in steps:
        raise NoCheckpointError(
            f"no checkpoint of update {updates} under {checkpoint_dir(run_dir)}; "
            f"there are: {', '.join(map(str, steps))}"
        )
    return updates


def _mismatch(run_dir: str, updates: int, why: str) -> CheckpointMismatch:
    return CheckpointMismatch(
        f"the checkpoint of update {updates} under {checkpoint_dir(run_dir)} does not fit "
        f"the network being built ({why}); give the settings its run trained with (its "
        "config.json), or another --run-dir for a new run"
    )


def _restore(run_dir: str, updates: int, **items: Any) -> dict[str, Any]:
    """Restores the named items (abstract trees, or None for the JSON meta)."""
    import orbax.checkpoint as ocp

    args = {
        name: ocp.args.JsonRestore()
        if example is None
        else ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, example))
        for name, example in items.items()
    }
    with ocp.CheckpointManager(
        checkpoint_dir(run_dir),
        options=ocp.CheckpointManagerOptions(
            create=False, multiprocessing_options=this_process_only(ocp)
        ),
    ) as manager:
        try:
            restored = dict(manager.restore(updates, args=ocp.args.Composite(**args)))
        except (ValueError, KeyError) as error:
            raise _mismatch(run_dir, updates, str(error)) from error
    for name, example in items.items():
        if example is None:
            continue
        # orbax restores numpy examples at the stored shapes without a word.
        for (path, want), got in zip(
            jax.tree_util.tree_leaves_with_path(example),
            jax.tree.leaves(restored[name]),
            strict=True,
        ):
            if np.shape(got) != np.shape(want):
                raise _mismatch(
                    run_dir,
                    updates,
                    f"{name}{jax.tree_util.keystr(path)}: stored {np.shape(got)}, "
                    f"built {np.shape(want)}",
                )
    return restored


def load_state(
    run_dir: str, example_params: Any, example_opt_state: Any, updates: int | None = None
) -> tuple[Any, Any, dict]:
    """Parameters, optimizer state and counters of a checkpoint (the newest by default),
    for resuming a run; the examples give the trees' structures, shapes and dtypes."""
    updates = _choose(run_dir, updates)
    items: dict[str, Any] = {"params": example_params, "meta": None}
    if jax.tree.leaves(example_opt_state):
        items["opt_state"] = example_opt_state
    restored = _restore(run_dir, updates, **items)
    return restored["params"], restored.get("opt_state", example_opt_state), restored["meta"]


def resolve(path: str) -> tuple[str, int | None]:
    """A run directory, its checkpoints/ directory, or one checkpoint's directory ->
    (run directory, update count or None for the newest)."""
    path = os.path.abspath(path.rstrip("/"))
    parent, name = os.path.split(path)
    if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:
        return os.path.dirname(parent), int(name)
    if name == CHECKPOINT_DIR:
        return parent, None
    return path, None


def load_params(run_dir: str, example_params: Any, updates: int | None = None) -> tuple[Any, dict]:
    """The parameters and counters of a checkpoint (the newest when `updates` is None).

    `example_params` gives the tree's structure, shapes and dtypes (for
    instance the network's freshly initialised parameters).
    """
    updates = _choose(run_dir, updates)
    restored = _restore(run_dir, updates, params=example_params, meta=None)
    return restored["params"], dict(restored["meta"])


def starting_state(
    run_dir: str, init_checkpoint: str, params: Any, opt_state: Any
) -> tuple[Any, Any, dict | None]:
    """A run's first state: its run directory's newest checkpoint (resumed), else the
    parameters of `init_checkpoint` (a run directory or RUN_DIR/checkpoints/UPDATES) with a
    fresh optimizer, else `params` and `opt_state` as given. (params, optimizer state, and
    the resumed checkpoint's metadata or None for a new run.)"""
    if available(run_dir):
        params, opt_state, meta = load_state(run_dir, params, opt_state)
        logger.info(
            "resuming %s from its checkpoint of update %d (%d env steps)",
            run_dir,
            int(meta["updates"]),
            meta["env_steps"],
        )
        if init_checkpoint:
            logger.warning("--init-checkpoint ignored: the run resumes its own checkpoint")
        return params, opt_state, meta
    if init_checkpoint:
        source, updates = resolve(init_checkpoint)
        params, meta = load_params(source, params, updates)
        logger.info(
            "a new run from the parameters of %s, update %d", init_checkpoint, meta["updates"]
        )
    return params, opt_state, None
