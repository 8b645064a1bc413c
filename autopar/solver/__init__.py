"""The planner: pricing of concrete configurations (`pricing`) and the search over them (`search`).

See `autopar.solver.search` for the formulation.
"""

from .pricing import CostModel, Priced, price, tp_layer_cost
from .search import search

__all__ = ["CostModel", "Priced", "price", "search", "tp_layer_cost"]
