"""The persistent compilation cache: the XLA programs a learner compiles, kept on disk, so
that its next start with the same programs (a restart, a resume, a rerun) loads them
instead of compiling them again. JAX keys, bounds and checks the entries
(docs/architecture.md, "Start-up and the compilation cache"); this module points it at
its directory and counts what it answered, for the learner's log.
"""

from __future__ import annotations

import dataclasses
import os
import threading

DEFAULT_MAX_BYTES = 2 << 30
"""Bound on the directory: an Atari learner's programs take a few MB per setting."""
MIN_COMPILE_S = 0.1
"""Programs that compile faster than this are not written: they would load about as
fast as they compile."""


def default_dir() -> str:
    """JAX_COMPILATION_CACHE_DIR where the user set it (JAX's own variable), else
    $XDG_CACHE_HOME/seedrl/xla (~/.cache/seedrl/xla)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "seedrl", "xla")


@dataclasses.dataclass
class Counts:
    """This process's compiles that asked the cache, those it answered, and the compile
    time those answers saved (as JAX measured them when it wrote them)."""

    requests: int = 0
    hits: int = 0
    saved_s: float = 0.0


_counts = Counts()
_lock = threading.Lock()
_directory: str | None = None

_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def _on_event(event: str, **_: object) -> None:
    with _lock:
        if event == _REQUEST:
            _counts.requests += 1
        elif event == _HIT:
            _counts.hits += 1


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    if event == _SAVED:
        with _lock:
            _counts.saved_s += max(0.0, duration_s)


# JAX's bounded cache (jax._src.lru_cache) keeps each entry as KEY-cache beside KEY-atime,
# its last use, and reads every entry's KEY-atime whenever it writes one.
_ENTRY = "-cache"
_ATIME = "-atime"


def date_unbounded_entries(directory: str) -> None:
    """Gives each entry without a last-use time one: its file's own time.

    A JAX program that shares the directory with no bound on its size (JAX's default: any
    program with JAX_COMPILATION_CACHE_DIR set, which default_dir() follows too) writes
    entries without a KEY-atime. JAX's bounded cache then fails every write it makes, with
    a warning for each program, and the learner's programs are never kept."""
    import filelock

    # The lock JAX's bounded cache holds while it reads, writes and evicts.
    with filelock.FileLock(os.path.join(directory, ".lockfile"), timeout=10):
        names = set(os.listdir(directory))
        for name in names:
            if not name.endswith(_ENTRY):
                continue
            atime = name[: -len(_ENTRY)] + _ATIME
            if atime in names:
                continue
            stamp = os.stat(os.path.join(directory, name)).st_mtime_ns
            with open(os.path.join(directory, atime), "wb") as file:
                file.write(stamp.to_bytes(8, "little"))


def enable(directory: str = "", max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Points JAX's persistent cache at `directory` (empty: default_dir()) and counts its
    answers; the directory used. Must run before this process's first compile: JAX
    decides once, at its first compile, whether a cache is in use."""
    global _directory
    import jax

    directory = os.path.abspath(os.path.expanduser(directory or default_dir()))
    os.makedirs(directory, exist_ok=True)
    date_unbounded_entries(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    if _directory is None:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _directory = directory
    return directory


def disable() -> None:
    """No persistent cache in this process: every program compiles afresh."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def configure(enabled: bool, directory: str = "") -> None:
    """enable(directory) or disable(), as a CLI's --[no-]compilation-cache says."""
    if enabled:
        enable(directory)
    else:
        disable()


def summary() -> str:
    """One line on what the cache answered in this process, for the learner's log."""
    if _directory is None:
        return "no compilation cache"
    with _lock:
        done = dataclasses.replace(_counts)
    if not done.requests:
        return f"compilation cache {_directory}"
    return (
        f"{done.hits} of {done.requests} programs loaded from the compilation cache "
        f"{_directory} ({done.saved_s:.1f} s of compiling saved)"
    )
