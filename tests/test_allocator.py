"""seedrl.allocator: glibc's thresholds, checked in fresh interpreters (they are process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from seedrl.allocator import DISABLE_VARIABLE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Blocks of 2 MiB made and freed three at a time, as an actor's step makes its
# observations, its message and gRPC's copy: minor page faults per round.
PROBE = """
import resource, sys
from seedrl import allocator
print(allocator.keep_freed_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
size = 2 * 1024 * 1024
for _ in range(5):
    blocks = [b"\\x01" * size for _ in range(3)]
    del blocks
before = faults()
for _ in range(20):
    blocks = [b"\\x01" * size for _ in range(3)]
    del blocks
print((faults() - before) / 20)
"""


def run_probe(disable_variable: str) -> tuple[str, float]:
    output = subprocess.run(
        [sys.executable, "-c", PROBE],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, DISABLE_VARIABLE: disable_variable},
    ).stdout.split()
    return output[0], float(output[1])


glibc_only = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator"
)


@glibc_only
def test_freed_blocks_are_kept_instead_of_faulted_in_again():
    default_set, default_faults = run_probe("0")
    kept_set, kept_faults = run_probe("1")
    assert (default_set, kept_set) == ("False", "True")
    # 1,536 pages per round: glibc's adaptive thresholds hand most of them back.
    assert default_faults > 300
    assert kept_faults < 10


@glibc_only
def test_the_actor_sets_them_before_it_starts():
    code = (
        "import sys, actors.main as m, seedrl.allocator as a; calls = [];"
        "a.keep_freed_memory = lambda: calls.append(1) or True;"
        "sys.argv = ['seedrl-actor', '--help'];\n"
        "try:\n    m.main()\nexcept SystemExit:\n    pass\nprint(len(calls))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout
    assert output.split()[-1] == "1"
