"""The planner, one sub-package per family:

- `search/`: the outer search (`search.search`: best-first branch and bound over device groupings, its
  formulation in that module's docstring), its candidates (`configs`), bounds, objectives, device subsets
  and the reasons nothing fits (`infeasible`);
- `split/`: one pipeline's layer split and stage options (`split.Splitter`), the surrogate objective, the
  CP-SAT stage models and selective recompute;
- `pricing/`: the cost model (`model.CostModel`), a whole plan priced and simulated (`pricing.price`), its
  communication, plan-level checks, per-stage memory, expert parallelism and zero-bubble weight gradients;
- `intra_op/`: the intra-operator (tensor-parallel) ILP and its price of a layer (`intra_op.pricing`);
- beside them, the training modes' planning: delayed updates (`asynchronous`, `async_memory`,
  `flushless_memory`), re-routing and stragglers (`reshare`, `reroute_memory`) and what they add to a step
  (`extra_memory`).
"""

from .pricing.pricing import CostModel, Priced, price, tp_layer_cost

__all__ = ["CostModel", "Priced", "price", "tp_layer_cost"]
