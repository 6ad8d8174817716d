"""python -m bench.tethered PARENT_PID MODULE [ARGS...]: runs MODULE as __main__ with
ARGS, and ends it (SIGKILL) when PARENT_PID, the process that started it, ends.

The benchmark's actors run through it. An actor outlives its learner by design (it
reconnects with backoff), so the actors of a benchmark that was killed, learner and
all, would otherwise go on retrying and take CPU from every later run on the machine.
Case (a)'s env processes (multiprocessing's) call `tether` themselves.

Linux's parent-death signal is tied to the thread that started the child: start
tethered processes from a thread that lives as long as they should (the main one).
Elsewhere than Linux the module runs untethered.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def command(module: str, *args: str) -> list[str]:
    """The command line that runs `python -m module args...` tethered to this process."""
    return [sys.executable, "-m", __name__, str(os.getpid()), module, *args]


def tether(parent_pid: int) -> None:
    """Ends this process when `parent_pid` ends; at once if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have ended before the signal was set: then no signal comes.
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m bench.tethered PARENT_PID MODULE [ARGS...]")
    parent_pid, module = int(sys.argv[1]), sys.argv[2]
    tether(parent_pid)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
