"""The dependency rules of docs/architecture.md, checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys


def modules_after_import(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return set(output.split())


def test_actors_never_import_jax():
    loaded = modules_after_import("import actors.main, actors.actor, envs.atari, envs.classic")
    assert "actors.actor" in loaded
    assert not {"jax", "flax", "optax"} & loaded


def test_the_shared_core_needs_only_numpy_grpc_and_protobuf():
    loaded = modules_after_import("import seedrl.codec, seedrl.specs, seedrl.transport")
    assert not {"jax", "gymnasium", "ale_py", "envs", "learner", "actors"} & loaded


def test_the_env_registry_loads_no_simulator_until_asked():
    loaded = modules_after_import("import envs.registry")
    assert not {"ale_py", "gymnasium"} & loaded


def test_the_benchmarks_actors_load_nothing_beyond_what_users_actors_do():
    # Its actors run under bench.tethered: anything it imported would weigh on what
    # the benchmark measures of them.
    loaded = modules_after_import("import bench.tethered")
    assert "bench.tethered" in loaded
    assert not {"numpy", "jax", "grpc", "envs", "learner", "actors"} & loaded
