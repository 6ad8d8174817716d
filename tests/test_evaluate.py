"""seedrl-eval's pieces and its refusals (the learning tests play real checkpoints)."""

from __future__ import annotations

import json
import subprocess

import pytest

from learner.evaluate import EvalConfig, quotas
from tests.fleet import ROOT

EVAL = str(ROOT / ".venv" / "bin" / "seedrl-eval")


@pytest.mark.parametrize(
    ("episodes", "envs", "expected"),
    [(20, 8, [3, 3, 3, 3, 2, 2, 2, 2]), (3, 3, [1, 1, 1]), (5, 1, [5]), (7, 2, [4, 3])],
)
def test_episodes_are_spread_evenly_over_envs(episodes, envs, expected):
    assert quotas(episodes, envs) == expected
    assert sum(quotas(episodes, envs)) == episodes


def test_config_refuses_nonsense():
    with pytest.raises(ValueError, match="episodes"):
        EvalConfig(run_dir="x", episodes=0)
    with pytest.raises(ValueError, match="num_envs"):
        EvalConfig(run_dir="x", num_envs=-1)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EVAL, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    result = run("--run-dir", str(tmp_path))
    assert result.returncode == 1
    assert "config.json not found" in result.stderr


def test_a_run_without_checkpoints_says_so(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"env": "classic:CartPole-v1", "network": "mlp", "mlp_hidden_sizes": [64, 64]})
    )
    result = run("--run-dir", str(tmp_path), "--episodes", "1")
    assert result.returncode == 1
    assert "no complete checkpoint under" in result.stderr


def test_usage_without_a_run_dir():
    result = run()
    assert result.returncode == 2
    assert "--run-dir" in result.stderr
