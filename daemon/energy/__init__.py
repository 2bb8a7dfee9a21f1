"""What the machine can spare: power and thermal state, keeping awake, process priority, CPU measurement."""
