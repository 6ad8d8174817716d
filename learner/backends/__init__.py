"""Where and how the learner computes: its devices, and what a CPU needs of its own."""
