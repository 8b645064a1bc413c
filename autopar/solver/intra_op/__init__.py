"""Intra-operator parallelism: a sharding strategy per op chosen by an ILP (intra_op.py has the formulation;
build.py, problem.py, ilp.py, shared.py, strategies.py, context.py its parts) and the planner's price of a
tensor-parallel layer from it (pricing.py)."""
