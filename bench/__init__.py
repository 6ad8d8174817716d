"""seedrl's throughput benchmarks: `scripts/bench.sh` or `python -m bench`."""
