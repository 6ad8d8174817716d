"""The persistent compilation cache (learner/backends/compile_cache.py), through
seedrl-learner and seedrl-eval as users start them: started again with the same settings,
each loads the programs its first start wrote instead of compiling them;
--no-compilation-cache compiles every one and writes nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from learner.backends import compile_cache
from tests.fleet import ROOT, LoggedProcess, learner_argv, wait_until
from tests.test_evaluate import constant_run
from tests.test_evaluate import run as run_eval

CARTPOLE = "classic:CartPole-v1"


def log_once_serving(tmp_path, name: str, *flags: str) -> str:
    """The log of a CartPole learner started with `flags`, up to its serving."""
    learner = LoggedProcess(
        learner_argv(CARTPOLE, tmp_path / name, *flags), tmp_path / f"{name}.log"
    )
    try:
        wait_until(
            lambda: " serving " in learner.log() or learner.process.poll() is not None,
            300,
            "the learner to serve",
        )
        return learner.log()
    finally:
        learner.kill()


def loaded(log: str) -> tuple[int, int, float]:
    """(programs loaded, programs asked, seconds saved) from a log's cache line."""
    match = re.search(
        r"(\d+) of (\d+) programs loaded from the compilation cache "
        r"(\S+) \(([\d.]+) s of compiling saved\)",
        log,
    )
    assert match, log[-3000:]
    return int(match[1]), int(match[2]), float(match[4])


def entries(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith("-cache"))


def check_loaded_again(log: str, asked: int, written: list[str], cache) -> tuple[int, float]:
    """A second start's cache line against the first's, which asked for `asked` programs
    and wrote `written`: the programs it loaded and the seconds of compiling that saved."""
    hits, asked_again, saved = loaded(log)
    assert asked_again == asked
    assert hits == len(written), (hits, written)
    assert set(written) <= set(entries(cache))
    return hits, saved


def test_a_learner_started_again_loads_the_programs_its_first_start_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = log_once_serving(tmp_path, "first", "--compilation-cache-dir", str(cache))
    hits, asked, saved = loaded(first)
    assert hits == 0 and saved == 0 and asked > 0, first[-3000:]
    written = entries(cache)
    assert written, "the first start wrote no program"

    # Another run directory: nothing but the cache carries over.
    second = log_once_serving(tmp_path, "second", "--compilation-cache-dir", str(cache))
    # What the first start did not write (it compiled in under MIN_COMPILE_S) compiles
    # again, and a compile slowed past that bound by a busy machine is written now; no
    # entry the first start wrote is replaced.
    # CartPole's programs compile in tenths of a second, and a fast machine loads them
    # in about as long, so the seconds saved may print as 0.0 (the count is checked on
    # JAX's own events below): the programs loaded are what this checks.
    hits, _ = check_loaded_again(second, asked, written, cache)
    again = entries(cache)
    assert len(again) - len(written) <= asked - hits, (again, written)


def test_a_cache_an_unbounded_jax_program_wrote_to_keeps_the_learners_programs_too(tmp_path):
    """JAX's own default leaves the cache unbounded and its entries without a last-use
    time; the learner's bounded cache reads one for every entry whenever it writes."""
    cache = tmp_path / "cache"
    plain = subprocess.run(
        [sys.executable, "-c", "import jax, jax.numpy as jnp; jax.jit(jnp.sin)(1.0)"],
        cwd=ROOT,
        env={
            **os.environ,
            "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    theirs = entries(cache)
    assert theirs and not [name for name in os.listdir(cache) if name.endswith("-atime")]

    log = log_once_serving(tmp_path, "run", "--compilation-cache-dir", str(cache))
    assert "Error writing persistent compilation cache" not in log, log[-3000:]
    assert set(entries(cache)) > set(theirs), "the learner wrote no program"
    names = set(os.listdir(cache))
    assert all(name.removesuffix("-cache") + "-atime" in names for name in entries(cache))


def test_without_the_cache_every_program_compiles_and_nothing_is_written(tmp_path):
    cache = tmp_path / "cache"
    log = log_once_serving(
        tmp_path, "run", "--no-compilation-cache", "--compilation-cache-dir", str(cache)
    )
    assert re.search(r"compiled in [\d.]+ s: no compilation cache", log), log[-3000:]
    assert not cache.exists()


def test_seedrl_eval_started_again_loads_the_policy_its_first_start_compiled(tmp_path):
    run_dir = constant_run(tmp_path / "run", "atari:Pong")
    cache = tmp_path / "cache"
    flags = ("--run-dir", str(run_dir), "--episodes", "1", "--compilation-cache-dir", str(cache))
    first = run_eval(*flags)
    assert first.returncode == 0, first.stderr[-3000:]
    hits, asked, saved = loaded(first.stderr)
    assert hits == 0 and saved == 0 and asked > 0, first.stderr[-3000:]
    written = entries(cache)
    assert written, "the first evaluation wrote no program"

    second = run_eval(*flags)
    assert second.returncode == 0, second.stderr[-3000:]
    # The policy's programs compile in tenths of a second: on a fast machine loading one
    # saves less than the 0.1 s the line shows, so only the programs loaded are checked.
    check_loaded_again(second.stderr, asked, written, cache)
    # The same play either way: NOOP for ever loses 21-0; the JSON result still ends stdout.
    assert json.loads(second.stdout.strip().splitlines()[-1])["mean"] == -21.0

    uncached = run_eval(
        *flags[:4], "--no-compilation-cache", "--compilation-cache-dir", str(tmp_path / "none")
    )
    assert uncached.returncode == 0, uncached.stderr[-3000:]
    assert "seedrl-eval: no compilation cache" in uncached.stderr
    assert not (tmp_path / "none").exists()


def test_the_cache_directory_follows_jax_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "seedrl" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" / "seedrl" / "xla")


def test_the_seconds_saved_sum_what_each_load_saved_and_no_load_costs_any(monkeypatch):
    """JAX reports each load's compile time less its retrieval; a load slower than the
    compile it replaced counts as none saved, not as time taken from the others."""
    monkeypatch.setattr(compile_cache, "_counts", compile_cache.Counts())
    monkeypatch.setattr(compile_cache, "_directory", "/cache")
    for _ in range(3):
        compile_cache._on_event(compile_cache._REQUEST)
    for saved in (1.25, -0.5, 0.5):
        compile_cache._on_event(compile_cache._HIT)
        compile_cache._on_duration(compile_cache._SAVED, saved)
    compile_cache._on_duration("/jax/compilation_cache/cache_retrieval_time_sec", 9.0)
    assert compile_cache.summary() == (
        "3 of 3 programs loaded from the compilation cache /cache (1.8 s of compiling saved)"
    )
