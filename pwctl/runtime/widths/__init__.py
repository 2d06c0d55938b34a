"""Which width each expert block runs at: the budgeted policies' allocator, the planner (damage x
hot factor x residual; free / promote) and the planned widths (WidthPlan)."""
