"""The planner's cost model (model.py: per-stage times; comm.py: collectives; stage_memory.py: per-device
memory), a whole plan priced and simulated (pricing.py), plan-level checks (plan.py), expert parallelism and
the zero-bubble weight-gradient share."""
