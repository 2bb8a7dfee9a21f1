"""The plan as data and the decisions read from it: `ExpertPlan`, the cost model, residency, measured costs."""
