"""Synthetic models for the demo, benchmarks and tests: tiny random checkpoints, a byte tokenizer, real geometries.
The engine's core never imports this package.
"""
