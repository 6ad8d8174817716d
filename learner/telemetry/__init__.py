"""What a run reports: stats, metrics.jsonl, TensorBoard event files, the HTTP page and /metrics."""
