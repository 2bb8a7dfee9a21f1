"""Benchmarks of the service around the engine: what the daemon costs the person's foreground work, the queue's
claims under many workers, search latency at archive scale."""
