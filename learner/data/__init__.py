"""What the learner keeps of the streams: the unroll store, frame stacks, training rewards."""
