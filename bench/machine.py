"""What the figures were measured on: the machine, the software, the commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jax", "jaxlib", "flax", "optax", "grpcio", "protobuf", "numpy", "ale-py", "torch")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return round(pages * page_size / 2**30, 1)


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def commit() -> str:
    """HEAD's hash, with "+dirty" when the working tree has changes; "unknown" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_times() -> list[int] | None:
    """The machine's cumulative CPU times (/proc/stat): user nice system idle iowait irq
    softirq steal; to compute the steal share of an interval."""
    try:
        with open("/proc/stat") as stat:
            return [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to others between two `cpu_times`."""
    if not before or not after:
        return None
    deltas = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(deltas)
    return round(deltas[7] / total, 3) if total else None


def describe() -> dict:
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": _versions(),
    }


def context(settings: dict) -> dict:
    """What every results file carries beside its figures: the machine, the commit, the
    settings it ran with and when it started."""
    return {
        "machine": describe(),
        "commit": commit(),
        "settings": settings,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
