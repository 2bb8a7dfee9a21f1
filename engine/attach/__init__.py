"""What the engine swaps into a loaded model while it runs: the experts, dense projections, norms and attention."""
