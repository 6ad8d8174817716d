"""What every benchmark case shares: settings, results, timing helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import resource
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long and how big each case runs."""

    short: bool = False
    """Seconds per case instead of minutes (the test suite's smoke run)."""
    out_dir: str = ""
    """Where results.json and the plots go; empty: runs/bench-TIMESTAMP."""
    duration_s: float = 20.0
    """Measured window of each configuration (case (b)'s: `serving_duration_s`)."""
    serving_duration_s: float = 10.0
    """Measured window of each case (b) row. Its figures are means over 10^4-10^6 actor
    steps in one window, with nothing to alternate, so they need less time than (c)'s
    ratios."""
    warmup_s: float = 5.0
    """Unmeasured time before each window: compilation, connection, caches."""
    processes: int = 0
    """P of cases a, c, d: env processes; 0: one per core."""
    envs_per_process: int = 32
    """K of cases a, c, d: envs per process (c's first row; its others are actors of 2 and
    8 times the env preset's inference batch, in 2 groups)."""


@dataclasses.dataclass
class Column:
    key: str
    header: str
    fmt: str = "{:,.0f}"


@dataclasses.dataclass
class CaseResult:
    """One case's figures: a row per configuration, as printed and as written to JSON."""

    case: str
    """"a".."f"."""
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    """What bounds the figures, what was skipped and why."""
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Figures derived from several rows (ratios)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "title": self.title,
            "rows": self.rows,
            "summary": self.summary,
            "notes": self.notes,
        }


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's reaped children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def processes_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of other, running processes (all their threads), as the
    kernel counts it (in clock ticks: 10 ms on most kernels)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command's closing parenthesis: utime and stime are fields 14, 15.
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _CLOCK_TICKS


def pause_processes(pids: list[int], pause: bool) -> None:
    """Stops the processes (SIGSTOP: the kernel runs none of their threads), or lets them
    go on (SIGCONT)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP if pause else signal.SIGCONT)


def _threads(pid: int) -> list[int]:
    return [int(task) for task in os.listdir(f"/proc/{pid}/task")]


def pin_processes(pids: list[int], cpus: set[int]) -> None:
    """Runs every thread of the processes on `cpus` only (threads they start later
    inherit it from the thread that starts them)."""
    for pid in pids:
        # Twice: a thread started while the first pass ran may have missed it.
        for _ in range(2):
            for thread in _threads(pid):
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.sched_setaffinity(thread, cpus)


def cpus_of(pids: list[int]) -> list[int]:
    """The cores any thread of the processes may run on, as the kernel reports them."""
    cpus: set[int] = set()
    for pid in pids:
        for thread in _threads(pid):
            with contextlib.suppress(ProcessLookupError):
                cpus |= os.sched_getaffinity(thread)
    return sorted(cpus)


def alternating(windows: int) -> list[bool]:
    """Which of `windows` windows measure the side under test: on, off, off, on, ...
    (an ABBA order, so that a drift of the machine's speed weighs on both sides alike).
    Each window of the side under test is paired with the window beside it, so the
    count must be even."""
    if windows < 2 or windows % 2:
        raise ValueError(f"windows must be even and at least 2, got {windows}")
    return [index % 4 in (0, 3) for index in range(windows)]


def student_t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile (above 0.5) of Student's t distribution with `df`
    degrees of freedom: bisection on its CDF, integrated from the density (Simpson's
    rule), good to about 1e-6 for the quantiles confidence intervals use."""
    if not 0.5 < probability < 1 or df < 1:
        raise ValueError(f"need 0.5 < probability < 1 and df >= 1, got {probability}, {df}")
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_scale - (df + 1) / 2 * math.log1p(t * t / df))

    def cdf(x: float, panels: int = 2000) -> float:
        h = x / panels
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, panels))
        return 0.5 + h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """The mean of independent measurements and the half-width of its `level`
    confidence interval (Student's t, from their spread); None for fewer than two."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    spread = statistics.stdev(values, mean)
    return mean, student_t_quantile((1 + level) / 2, len(values) - 1) * spread / math.sqrt(
        len(values)
    )


def cores() -> int:
    return len(os.sched_getaffinity(0))


class Window:
    """A measured interval: wall time and this process's CPU time."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = cpu_seconds()

    def elapsed(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds) since the window opened."""
        return time.perf_counter() - self.wall, cpu_seconds() - self.cpu


def drain_unrolls(unrolls: queue.Queue, stop: threading.Event, recycle) -> None:
    """Takes a learner's unrolls where its trainer would, and gives them back as it does."""
    while not stop.is_set():
        try:
            recycle([unrolls.get(timeout=0.1)])
        except queue.Empty:
            continue
