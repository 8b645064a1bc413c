"""The outer search over configurations (search.py, formulation in its docstring), its candidates, bounds,
objectives and device subsets, and why nothing fits (infeasible.py)."""
