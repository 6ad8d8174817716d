"""Acting: the inference loop over the batcher's requests, and playing parameters on envs of its own."""
