"""`npumoed bench fidelity`: what capacity tiers and weights formats cost in accuracy. capacity.py sweeps the
tiers, weights.py and real_text.py compare the formats with the float model, run.py runs them for the command,
plot.py draws the sweep."""
