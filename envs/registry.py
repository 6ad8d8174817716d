"""Environment ids such as "atari:Pong" or "classic:CartPole-v1" to vector envs.

An id is FAMILY:NAME. Each family is a module with `make(name, num_envs,
seed, **options)` and `spec(name)`; it is imported only when first used, so
that listing or parsing ids loads neither ale-py nor gymnasium.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from envs.base import VectorEnv
from seedrl.specs import EnvSpec

_FAMILIES: dict[str, str] = {
    "atari": "envs.atari",
    "classic": "envs.classic",
    "counting": "envs.counting",
    "football": "envs.football",
    "memory": "envs.memory",
}


class UnknownEnvError(ValueError):
    """An env id that no family can make."""


def register_family(family: str, module: str) -> None:
    """Adds a family of envs implemented by `module` (see the module docstring)."""
    _FAMILIES[family] = module


def families() -> list[str]:
    return sorted(_FAMILIES)


def split_env_id(env_id: str) -> tuple[str, str]:
    family, sep, name = env_id.partition(":")
    if not sep or not name:
        raise UnknownEnvError(
            f"env id {env_id!r} is not FAMILY:NAME; families: {', '.join(families())}"
        )
    if family not in _FAMILIES:
        raise UnknownEnvError(
            f"env family {family!r} of {env_id!r} is unknown; families: {', '.join(families())}"
        )
    return family, name


def _family(env_id: str) -> tuple[Any, str]:
    family, name = split_env_id(env_id)
    return importlib.import_module(_FAMILIES[family]), name


def make(env_id: str, num_envs: int, seed: int | None = None, **options: Any) -> VectorEnv:
    """K envs of `env_id` stepping together."""
    if num_envs < 1:
        raise ValueError(f"num_envs must be at least 1, got {num_envs}")
    module, name = _family(env_id)
    return module.make(name, num_envs=num_envs, seed=seed, **options)


@functools.cache
def spec(env_id: str) -> EnvSpec:
    """The observation and action spec of `env_id` (may briefly build one env)."""
    module, name = _family(env_id)
    return module.spec(name)
