"""The learner: gRPC server, dynamic batcher, inference, unroll store and V-trace trainer.

Importing it sets nothing: the programs (seedrl-learner, seedrl-eval, the benchmarks,
the tests) apply the learner's XLA flags (learner/backends/cpu/xla_flags.py) before JAX
starts, and a program that builds a `Learner` itself gets them from it while JAX has
not started yet.
"""
