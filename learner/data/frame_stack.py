"""Frame stacking on the learner: the actor sends one frame per step, the model sees S.

An env whose spec has `frame_stack` S > 1 sends one observation per step;
the learner keeps each env slot's recent frames and gives the model the last
S of them concatenated along the first axis, oldest first. Frames from
before the current episode's first frame are zeros, as ale-py's own stacking
makes them, so a model trained either way sees the same inputs
(tests/test_frame_stack.py checks it against ale-py frame for frame).

Sending one 84x84 frame instead of four cuts the bytes through gRPC, the
codec and the unroll store by S; the stacks are rebuilt where they are used:
the inference batch on the host, the training batch on the device.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from learner.backends.cpu.host_arrays import aligned_zeros
from seedrl.specs import EnvSpec


def window_validity(first: np.ndarray) -> np.ndarray:
    """bool [..., S] episode starts in windows of S frames -> bool [..., S]: whether each
    frame belongs to the episode of the window's newest (last) frame."""
    # A frame is valid when no episode starts after it within the window.
    starts_from = np.logical_or.accumulate(first[..., ::-1], axis=-1)[..., ::-1]
    valid = np.ones(first.shape, np.bool_)
    valid[..., :-1] = ~starts_from[..., 1:]
    return valid


def frame_indices(first: np.ndarray, stack: int) -> np.ndarray:
    """bool [T+S, B] episode starts of B unrolls' frames -> int32 [T+1, B, S].

    Entry [t, b, k] is the frame that step t of unroll b sees in place k of
    its stack (frames t .. t+S-1, the newest last), or -1 for a zero frame.
    """
    windows = sliding_window_view(first, stack, axis=0)  # [T+1, B, S]
    steps = windows.shape[0]
    positions = np.arange(steps)[:, None, None] + np.arange(stack)[None, None, :]
    return np.where(window_validity(windows), positions, -1).astype(np.int32)


class FrameStacker:
    """The stacks of K envs stepped together, for code that runs a policy itself (evaluation)."""

    def __init__(self, spec: EnvSpec, num_envs: int):
        self._stack = spec.frame_stack
        model = spec.model_observation
        self._frames = aligned_zeros((num_envs, *model.shape), model.np_dtype)
        self._channels = spec.observation.shape[0] if spec.frame_stack > 1 else 0

    def __call__(self, observations: np.ndarray, first: np.ndarray) -> np.ndarray:
        """The model's input [K, S*C, ...] after the envs' newest observations [K, C, ...];
        `first` bool [K] says which of them start an episode."""
        if self._stack == 1:
            return observations
        channels = self._channels
        self._frames[:, :-channels] = self._frames[:, channels:]
        self._frames[:, -channels:] = observations
        self._frames[first, :-channels] = 0
        return self._frames
