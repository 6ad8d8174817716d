"""The learner: gRPC server, dynamic batcher, inference, unroll store and V-trace trainer.

Importing it sets the learner's XLA flags (learner/xla_flags.py) while they
can still take effect, so a learner built in any program (the CLI, tests,
benchmarks, a notebook) gets the same fast CPU convolutions.
"""

from learner import xla_flags

xla_flags.apply()
