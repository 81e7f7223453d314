"""The memory tools: footprint, estimate, track, peak prediction and the budget planner,
against measurements on real groups."""
