"""Learner-side assembly of unrolls, one env slot at a time.

Every env of every connected actor owns a slot. Before inference the store
takes each slot's new observation and writes what the policy sees into the
batch (`observe`): the observation itself, or with frame stacking (S > 1,
see learner/data/frame_stack.py) the slot's last S frames. After inference it
appends, per slot, the action chosen, that action's log-probability, the
reward and flags that came with the observation, and the policy version
(`append`). When a slot holds T+1 steps it emits an unroll and keeps its
last step as the first of the next one (the one-step overlap: the last step
of an unroll is only bootstrapped from). With S > 1 an unroll carries one
frame per step and the S-1 frames before its first step, T+S in all; the
trainer rebuilds the stacks on the device.

An emitted unroll's observations are the slot's own frame buffer, not a copy:
the slot goes on in a spare buffer, carrying over only the S frames the next
unroll starts with, and `recycle` gives the buffer back once the trainer has
stacked it, so the frames are written once (docs/benchmarks.md, "What was tried").

A slot belongs to one stream (one run of one actor). When a stream ends its
slots are freed and their partial unrolls dropped; a new run gets fresh slots
and so never continues an old run's unroll. Each slot records its owner, and
appends for a slot whose owner has changed since the batch was formed are
dropped, so a batch still in flight when its stream ended cannot write into
the slot's next owner.

Episode returns are kept here too, raw and as training sees them (rewards scaled
and clipped), since the store sees every step of every env in order.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from learner.data.frame_stack import window_validity
from learner.data.rewards import REWARD_CLIPPINGS, training_rewards
from seedrl.codec import EnvStep
from seedrl.specs import TensorSpec

logger = logging.getLogger(__name__)

FREE = -1


class Unroll(NamedTuple):
    """T+1 consecutive steps of one env, in time order."""

    observations: np.ndarray
    """[T+S, *observation_shape]: the S-1 frames before step 0 (S = frame_stack), then
    one per step; [T+1, ...] without frame stacking."""
    first: np.ndarray
    """bool [T+S]: the observation at each position is the first of its episode."""
    actions: np.ndarray
    """int32 [T+1]."""
    behaviour_log_probs: np.ndarray
    """float32 [T+1]."""
    rewards: np.ndarray
    """float32 [T+1], raw."""
    terminated: np.ndarray
    """bool [T+1]."""
    truncated: np.ndarray
    """bool [T+1]."""
    policy_versions: np.ndarray
    """int64 [T+1]: version of the parameters that chose each action."""
    owner: int
    """The stream whose env produced it."""
    slot: int = -1
    """The env slot it came from."""
    core_state: Any = None
    """Recurrent agents: the core state before step 0 (on the inference device)."""


class EpisodeStats(NamedTuple):
    returns: list[float]
    """Raw (unclipped) returns of the episodes that ended."""
    clipped_returns: list[float]
    """Their returns with the rewards scaled and clipped as in training."""
    lengths: list[int]
    """Their lengths in agent steps."""
    env_steps: int
    """Transitions seen (observations that are not the first of an episode)."""


class UnrollStore:
    """Per-slot ring of the current unroll; thread-safe."""

    def __init__(
        self,
        unroll_length: int,
        observation_spec: TensorSpec,
        initial_slots: int = 64,
        reward_clipping: str = "none",
        frame_stack: int = 1,
        reward_scale: float = 1.0,
    ):
        """`observation_spec` is one step's observation as the actors send it;
        `reward_clipping` ("abs_one" or "none") and `reward_scale` are the training's,
        for clipped returns; `frame_stack` S: the policy sees each slot's last S
        observations."""
        if unroll_length < 1:
            raise ValueError(f"unroll_length must be at least 1, got {unroll_length}")
        if frame_stack < 1:
            raise ValueError(f"frame_stack must be at least 1, got {frame_stack}")
        if reward_clipping not in REWARD_CLIPPINGS:
            raise ValueError(f"unknown reward_clipping {reward_clipping!r}")
        self.unroll_length = unroll_length
        self.frame_stack = frame_stack
        self._reward_clipping = reward_clipping
        self._reward_scale = reward_scale
        self._observation_spec = observation_spec
        self._lock = threading.Lock()
        self._capacity = 0
        self._free: deque[int] = deque()
        # Every slot's frames live in one of the rows of `_frames`, `_buffer_of[slot]`;
        # the other rows are lent to emitted unrolls or spare. `_lent` maps the id of
        # each array lent to (that array, its row): only that very array gives the row
        # back. Spare rows are left untouched until a slot first goes on in one, so
        # they cost no memory before.
        self._frames = np.zeros((0,), self._observation_spec.np_dtype)
        self._buffer_of = np.zeros((0,), np.int64)
        self._lent: dict[int, tuple[np.ndarray, int]] = {}
        self._spare_buffers: list[int] = []
        # Once no buffer is spare, unrolls are copies; their arrays, given back (by id),
        # are reused for the next copies (fresh memory would cost more page faults than
        # the copy itself).
        self._spare_copies: dict[int, np.ndarray] = {}
        self._copied_unrolls = 0
        self._allocate_arrays(max(1, initial_slots))

    # -- slots --------------------------------------------------------------

    def _allocate_arrays(self, capacity: int) -> None:
        """Grows every per-slot array to `capacity` slots, keeping their contents."""
        steps = self.unroll_length + 1
        frames = self.unroll_length + self.frame_stack
        layout = {  # name: (shape after the slot dimension, dtype, initial value)
            "_first": ((frames,), np.bool_, True),
            "_actions": ((steps,), np.int32, 0),
            "_log_probs": ((steps,), np.float32, 0),
            "_rewards": ((steps,), np.float32, 0),
            "_terminated": ((steps,), np.bool_, False),
            "_truncated": ((steps,), np.bool_, False),
            "_versions": ((steps,), np.int64, 0),
            "_length": ((), np.int64, 0),
            "_owner": ((), np.int64, FREE),
            # Episode bookkeeping: whether the next observation starts an episode.
            "_episode_start": ((), np.bool_, True),
            "_episode_return": ((), np.float64, 0.0),
            "_episode_clipped_return": ((), np.float64, 0.0),
            "_episode_length": ((), np.int64, 0),
        }
        for name, (shape, dtype, fill) in layout.items():
            grown = np.full((capacity, *shape), fill, dtype)
            if self._capacity:
                grown[: self._capacity] = getattr(self, name)
            setattr(self, name, grown)
        self._allocate_frames(capacity, frames)
        self._free.extend(range(self._capacity, capacity))
        self._capacity = capacity

    def _allocate_frames(self, capacity: int, frames: int) -> None:
        """A frame buffer for each of `capacity` slots and as many spares; the slots' own
        buffers keep their contents. Unrolls lent from the old array keep it alive
        and are not taken back (they are no longer in `_lent`)."""
        grown = np.zeros(
            (2 * capacity, frames, *self._observation_spec.shape),
            self._observation_spec.np_dtype,
        )
        if self._capacity:
            np.take(self._frames, self._buffer_of, axis=0, out=grown[: self._capacity])
        self._frames = grown
        self._buffer_of = np.arange(capacity, dtype=np.int64)
        self._lent = {}
        # Last in, first out: the buffer given back most recently is still in the caches.
        self._spare_buffers = list(range(2 * capacity - 1, capacity - 1, -1))

    def allocate(self, owner: int, count: int) -> np.ndarray:
        """`count` empty slots for the stream `owner`."""
        with self._lock:
            # First in, first out: a freed slot is reused as late as possible.
            if len(self._free) < count:
                self._allocate_arrays(max(2 * self._capacity, self._capacity + count))
            slots = np.array([self._free.popleft() for _ in range(count)], np.int64)
            self._owner[slots] = owner
            self._length[slots] = 0
            self._episode_start[slots] = True
            self._episode_return[slots] = 0.0
            self._episode_clipped_return[slots] = 0.0
            self._episode_length[slots] = 0
            return slots

    def release(self, owner: int, slots: np.ndarray) -> tuple[int, int]:
        """Frees the slots of a stream that ended, dropping its partial unrolls.

        Returns what was dropped: (partial unrolls, transitions in them). A slot
        holding only the step an emitted unroll ended on drops no transition.
        """
        with self._lock:
            mine = slots[self._owner[slots] == owner]
            transitions = np.maximum(self._length[mine].astype(np.int64) - 1, 0)
            self._owner[mine] = FREE
            self._length[mine] = 0
            self._free.extend(mine.tolist())
            return int(np.count_nonzero(transitions)), int(transitions.sum())

    def recycle(self, unrolls: list[Unroll]) -> None:
        """Takes back the frame buffers of unrolls the caller is done with.

        Only for unrolls nothing refers to any more, views of their observations
        included: the buffers will be overwritten. An unroll given back twice is
        taken back once. Optional: a buffer not given back stays the unroll's, and
        once none is spare unrolls are emitted as copies (`copied_unrolls`; garbage
        collected as usual where not given back).
        """
        with self._lock:
            for unroll in unrolls:
                observations = unroll.observations
                array, buffer = self._lent.get(id(observations), (None, -1))
                if array is observations:
                    del self._lent[id(observations)]
                    self._spare_buffers.append(buffer)
                elif (
                    observations.base is None  # a copy
                    and observations.shape == self._frames.shape[1:]
                    and observations.dtype == self._frames.dtype
                    and observations.flags.writeable
                    and id(observations) not in self._spare_copies
                    and len(self._spare_copies) < 2 * self._capacity
                ):
                    self._spare_copies[id(observations)] = observations

    @property
    def copied_unrolls(self) -> int:
        """Unrolls emitted as copies because no frame buffer was spare (unrolls kept and
        not given back hold theirs)."""
        return self._copied_unrolls

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return self._capacity - len(self._free)

    # -- steps --------------------------------------------------------------

    def observe(
        self,
        slots: np.ndarray,
        owners: np.ndarray,
        observations: np.ndarray | Sequence[np.ndarray],
        out: np.ndarray,
        first_out: np.ndarray | None = None,
        at_start_out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Takes N slots' new observations and writes what the policy sees into `out`.

        `observations` is [N, *observation_shape], or arrays whose rows, in order,
        are those N (one per actor message: the batch is not concatenated first);
        `out` is [N, S * shape[0], ...] (or [N, *observation_shape] without
        stacking). Rows of slots whose owner changed are zeros. Call `append` for
        the same slots after inference.
        For recurrent agents, bool [N] `first_out` gets whether each observation
        starts an episode, and `at_start_out` whether it is step 0 of an unroll
        (a new slot's first, or the last step of the unroll it completes).
        Returns bool [N]: which slots still belong to `owners`.
        """
        parts = [observations] if isinstance(observations, np.ndarray) else observations
        stack = self.frame_stack
        num = len(slots)
        if sum(len(part) for part in parts) != num:
            raise ValueError(f"observations for {sum(map(len, parts))} envs, slots for {num}")
        if not out.flags.c_contiguous:
            raise ValueError("observe() writes into a C-contiguous array only")
        with self._lock:
            live = self._owner[slots] == owners
            all_live = bool(live.all())  # the usual case: no masked copies
            length = self._length[slots]
            position = length + (stack - 1)  # where the new frame goes
            buffers = self._buffer_of[slots]
            if stack == 1:
                # The policy sees the new observation alone: one copy into `out`, and
                # the store's copy taken from there.
                if len(parts) == 1:
                    np.copyto(out, parts[0])
                else:
                    np.concatenate(parts, out=out)
                if all_live:
                    self._frames[buffers, position] = out
                else:
                    self._frames[buffers[live], position[live]] = out[live]
                    out[~live] = 0
            else:
                start = 0
                for part in parts:
                    rows = slice(start, start + len(part))
                    start = rows.stop
                    if all_live:
                        self._frames[buffers[rows], position[rows]] = part
                    else:
                        keep = live[rows]
                        self._frames[buffers[rows][keep], position[rows][keep]] = part[keep]
            mine, at = (slots, position) if all_live else (slots[live], position[live])
            self._first[mine, at] = self._episode_start[mine]
            if first_out is not None:
                first_out[:] = self._episode_start[slots]
            if at_start_out is not None:
                at_start_out[:] = (length == 0) | (length == self.unroll_length)
            if stack == 1:
                return live
            window = position[:, None] + np.arange(1 - stack, 1)  # [N, S], oldest first
            rows = buffers[:, None] * self._frames.shape[1] + window
            frames = self._frames.reshape(-1, *self._observation_spec.shape)
            stacked = out.reshape(num, stack, *self._observation_spec.shape)
            # Every row is in range; "clip" spares numpy's buffered copy of "raise".
            np.take(frames, rows, axis=0, out=stacked, mode="clip")
            valid = window_validity(self._first[slots[:, None], window]) & live[:, None]
            if not valid.all():
                stacked[~valid] = 0
            return live

    def append(
        self,
        slots: np.ndarray,
        owners: np.ndarray,
        step: EnvStep,
        actions: np.ndarray,
        log_probs: np.ndarray,
        policy_version: int,
    ) -> tuple[list[Unroll], EpisodeStats]:
        """Appends one step for each of N slots; returns the unrolls completed.

        The slots' observations came in `observe`, before inference; `step`
        brings their rewards and flags (its observations are not read).
        `slots` and `owners` are int [N]; the arrays of `step` and `actions`,
        `log_probs` have N as leading dimension.
        """
        with self._lock:
            live = self._owner[slots] == owners
            if not live.all():
                slots = slots[live]
                step = EnvStep(
                    None, step.rewards[live], step.terminated[live], step.truncated[live]
                )
                actions, log_probs = actions[live], log_probs[live]
            position = self._length[slots]
            self._actions[slots, position] = actions
            self._log_probs[slots, position] = log_probs
            self._rewards[slots, position] = step.rewards
            self._terminated[slots, position] = step.terminated
            self._truncated[slots, position] = step.truncated
            self._versions[slots, position] = policy_version
            self._length[slots] = position + 1
            stats = self._count_episodes(slots, step)
            return self._emit(slots[position + 1 == self.unroll_length + 1]), stats

    def _count_episodes(self, slots: np.ndarray, step: EnvStep) -> EpisodeStats:
        transition = ~self._episode_start[slots]
        rewards = np.where(transition, step.rewards, 0.0)
        self._episode_return[slots] += rewards
        self._episode_clipped_return[slots] += training_rewards(
            rewards, self._reward_clipping, self._reward_scale
        )
        self._episode_length[slots] += transition
        ended = slots[step.terminated | step.truncated]
        stats = EpisodeStats(
            returns=self._episode_return[ended].tolist(),
            clipped_returns=self._episode_clipped_return[ended].tolist(),
            lengths=self._episode_length[ended].tolist(),
            env_steps=int(transition.sum()),
        )
        self._episode_return[ended] = 0.0
        self._episode_clipped_return[ended] = 0.0
        self._episode_length[ended] = 0
        self._episode_start[slots] = step.terminated | step.truncated
        return stats

    def _copy_of(self, buffer: int) -> np.ndarray:
        source = self._frames[buffer]
        if not self._spare_copies:
            return source.copy()
        _, target = self._spare_copies.popitem()
        np.copyto(target, source)
        return target

    def _step_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-step arrays [slots, T+1] after `first`, in Unroll's field order."""
        return (
            self._actions,
            self._log_probs,
            self._rewards,
            self._terminated,
            self._truncated,
            self._versions,
        )

    def _emit(self, slots: np.ndarray) -> list[Unroll]:
        """The unrolls of the full `slots`; each slot keeps its last step to start the next."""
        if not len(slots):
            return []
        last, stack = self.unroll_length, self.frame_stack
        # Each unroll takes its slot's frame buffer while spares last (the slot goes on
        # in a spare, from the S frames it carries over), a copy of it after that.
        lending = min(len(slots), len(self._spare_buffers))
        spares = [self._spare_buffers.pop() for _ in range(lending)]
        lent, copied = self._buffer_of[slots[:lending]], self._buffer_of[slots[lending:]]
        observations = []
        for buffer in lent.tolist():
            view = self._frames[buffer]
            self._lent[id(view)] = (view, buffer)
            observations.append(view)
        observations += [self._copy_of(buffer) for buffer in copied.tolist()]
        self._frames[spares, :stack] = self._frames[lent, last:]
        self._frames[copied, :stack] = self._frames[copied, last:]
        self._buffer_of[slots[:lending]] = spares
        if len(copied):
            if not self._copied_unrolls:
                logger.info(
                    "no spare frame buffer: unrolls are copied (more than %d held and not "
                    "given back with recycle)",
                    self._capacity,
                )
            self._copied_unrolls += len(copied)
        # One gather per array for all of them; each unroll gets its own row (a view
        # of that copy), rather than ten small copies per unroll.
        per_step = [array[slots] for array in (self._first, *self._step_arrays())]
        unrolls = [
            Unroll(frames, *rows, owner=owner, slot=slot)
            for frames, slot, owner, rows in zip(
                observations,
                slots.tolist(),
                self._owner[slots].tolist(),
                zip(*per_step, strict=True),
                strict=True,
            )
        ]
        # The next unroll starts with this one's last step and the S-1 frames before it.
        self._first[slots, :stack] = self._first[slots, last:]
        for array in self._step_arrays():
            array[slots, 0] = array[slots, last]
        self._length[slots] = 1
        return unrolls
