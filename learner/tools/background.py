"""A learner serving from a background thread of the caller's process.

For programs that embed a learner rather than run `seedrl-learner`: tests,
benchmarks, notebooks. The learner gets its own event loop on its own thread;
the caller reads its stats, store and queues directly.
"""

from __future__ import annotations

import asyncio
import threading

from learner.learner import Learner


class BackgroundLearner:
    def __init__(self, learner: Learner, train: bool = True):
        """`learner` should be compiled already; `train=False`: the caller drains its unrolls."""
        self.learner = learner
        self._train = train
        self._ready = threading.Event()
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._main, name="learner-main", daemon=True)

    def _main(self) -> None:
        async def run() -> int:
            ready = asyncio.Event()
            task = asyncio.create_task(self.learner.run(ready=ready, train=self._train))
            waiting = asyncio.create_task(ready.wait())
            # Serving, or ended before it could serve (the exit code says why).
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            self._ready.set()
            return await task

        try:
            self.exit_code = asyncio.run(run())
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 60.0) -> BackgroundLearner:
        """Returns once the learner serves, or once it has ended (see exit_code)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the learner did not start serving within {timeout_s:g} s")
        return self

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the learner has ended, None while it still runs."""
        self._thread.join(timeout=timeout_s)
        return self.exit_code

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.learner.port}"

    def stop(self, timeout_s: float = 60.0) -> None:
        self.learner.stop()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the learner did not stop within {timeout_s:g} s")
