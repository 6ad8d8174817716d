"""The test program applies the learner's XLA flags before JAX starts, as seedrl-learner
does: learners built in-process compute as the CLI's do.

The suite's learners share one compilation cache of its own (JAX_COMPILATION_CACHE_DIR,
which seedrl-learner's default follows): each program compiles once per suite run, as on
a user's machine it compiles once, and the suite never reads or writes the user's cache.
"""

import atexit
import os
import shutil
import tempfile

# Before anything imports jax, which reads its variables once.
_cache_dir = tempfile.mkdtemp(prefix="seedrl-test-xla-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
atexit.register(shutil.rmtree, _cache_dir, True)

from learner.backends.compile_cache import DEFAULT_MAX_BYTES  # noqa: E402 (imports no jax)
from learner.backends.cpu import xla_flags  # noqa: E402

# Bounded as seedrl-learner bounds it, in this process and in every JAX program the tests
# start: each entry is then written with its last-use time, which the bounded cache reads.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(DEFAULT_MAX_BYTES)

xla_flags.apply()
