"""The dependency rules of docs/architecture.md, checked in fresh interpreters."""

from __future__ import annotations

import ast
import pathlib
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


# learner/'s parts along the data path, and the parts each may import (docs/architecture.md,
# "The learner's parts"). A part is a subpackage, or a module at the package's top.
LEARNER_IMPORTS: dict[str, set[str]] = {
    "backends": set(),
    "telemetry": set(),
    "data": {"backends"},
    "agents": {"backends", "data"},
    "serving": {"data", "telemetry"},
    "inference": {"agents", "backends", "data", "serving", "telemetry"},
    "config": {"agents", "backends"},
    "presets": {"config"},
    "training": {"agents", "backends", "config", "data", "inference", "telemetry"},
    "learner": {
        "agents",
        "backends",
        "config",
        "data",
        "inference",
        "serving",
        "telemetry",
        "training",
    },
    "main": {"agents", "backends", "config", "learner", "presets", "training"},
    "tools": {
        "agents",
        "backends",
        "config",
        "data",
        "inference",
        "learner",
        "presets",
        "training",
    },
}
LEARNER = pathlib.Path(__file__).resolve().parent.parent / "learner"


def learner_part(module: str) -> str | None:
    """The part of learner/ a dotted module name is in (None outside learner/)."""
    parts = module.split(".")
    if parts[0] != "learner":
        return None
    return parts[1] if len(parts) > 1 else "learner"


def imports_across_parts(root: pathlib.Path) -> set[tuple[str, str, str]]:
    """(importing file, its part, imported part) for every import from one part of the
    learner package under `root` into another, at any depth of the file."""
    found = set()
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        part = learner_part(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                other = learner_part(name)
                if other is not None and other != part:
                    found.add((str(path.relative_to(root.parent)), part, other))
    return found


def broken_rules(root: pathlib.Path) -> list[str]:
    return sorted(
        f"{path}: {part} imports {other}"
        for path, part, other in imports_across_parts(root)
        if other not in LEARNER_IMPORTS.get(part, set())
    )


def test_each_part_of_the_learner_imports_only_the_parts_below_it():
    assert imports_across_parts(LEARNER), "no imports found: the walk is broken"
    assert broken_rules(LEARNER) == []
    top = {path.stem for path in LEARNER.glob("*.py")} | {
        path.name for path in LEARNER.iterdir() if (path / "__init__.py").exists()
    }
    assert top - {"__init__"} <= set(LEARNER_IMPORTS), "a new part needs its rule"


def test_the_layering_check_finds_an_import_against_the_grain(tmp_path):
    # The check itself can fail: agents/ may not import telemetry/, serving/ not inference/.
    root = tmp_path / "learner"
    for part, body in {
        "agents": "from learner.telemetry.stats import LearnerStats\n",
        "serving": "import learner.inference.loop\n",
        "data": "from learner.backends.cpu import host_arrays\n",
    }.items():
        (root / part).mkdir(parents=True)
        (root / part / "__init__.py").write_text("")
        (root / part / "x.py").write_text(body)
    assert broken_rules(root) == [
        "learner/agents/x.py: agents imports telemetry",
        "learner/serving/x.py: serving imports inference",
    ]


def test_serving_never_imports_jax():
    # The event loop's side: parsing, checks and replies, with no device code to wait on.
    loaded = modules_after_import("import learner.serving.server")
    assert "learner.serving.server" in loaded
    assert "jax" not in loaded


def test_importing_the_learner_sets_no_global_state():
    # The XLA flags are the programs' to set (seedrl-learner, seedrl-eval, the benchmarks).
    code = (
        "import os; os.environ.pop('XLA_FLAGS', None); "
        "import learner, learner.learner, learner.main, learner.tools.evaluate, bench.attacks; "
        "print(os.environ.get('XLA_FLAGS'))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert output.strip() == "None"
