"""The gRPC side: the actor streams and the dynamic batcher (no jax)."""
