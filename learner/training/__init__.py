"""The trainer thread, its checkpoints, and the stop at a checked return."""
