"""The IMPALA agent: an actor-critic trained with V-trace targets."""
