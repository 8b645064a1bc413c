"""The planner: pricing of concrete configurations (`pricing`) and the search over them (`search`).

See the module `autopar.solver.search` for the formulation; its entry point is `autopar.solver.search.search`
(not re-exported here, so that `autopar.solver.search` stays the module).
"""

from .pricing import CostModel, Priced, price, tp_layer_cost

__all__ = ["CostModel", "Priced", "price", "tp_layer_cost"]
