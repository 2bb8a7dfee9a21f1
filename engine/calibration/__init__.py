"""Running text through a model to measure expert load, and making an `ExpertPlan` from it."""
