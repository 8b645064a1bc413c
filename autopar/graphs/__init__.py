"""Graph neural network workloads: generated graphs, GNN model cases, graph partitioning with halo exchange,
sampled mini-batch data parallelism, their cost model and planner, and a memory-based temporal GNN.

`autopar.plan` / `autopar.compile` route graph models here (planner.graph_kind); see docs/architecture.md.
"""

from __future__ import annotations

from .data import IGNORE, GraphData, locality_order, random_graph
from .models import GRAPH_CASES
from .planner import graph_kind, plan_graph
from .program import GraphProgram, TemporalProgram
from .sampling import sampled_graph, seeds_for_step
from .tgn import TGN, random_events

__all__ = ["GRAPH_CASES", "IGNORE", "TGN", "GraphData", "GraphProgram", "TemporalProgram", "graph_kind",
           "locality_order", "plan_graph", "random_events", "random_graph", "sampled_graph", "seeds_for_step"]
