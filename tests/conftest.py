"""The test program applies the learner's XLA flags before JAX starts, as seedrl-learner
does: learners built in-process compute as the CLI's do."""

from learner.backends.cpu import xla_flags

xla_flags.apply()
