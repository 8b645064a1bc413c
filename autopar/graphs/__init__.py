"""Graph neural network workloads: generated graphs, GNN model cases, graph partitioning with halo exchange,
sampled mini-batch data parallelism, their cost model and planner, and a memory-based temporal GNN.

`autopar.graphs.partition(x, edge_index, y, plan, out_dir)` writes partition-local data (store.py) that
`autopar.compile(model, cluster, loss_fn=..., graph_data=out_dir)` trains from, each rank reading only its part.
The node ranges, halos and their exchange are halo.py's.

A GNN too deep for one rank can split its message-passing layers over the ranks instead (graph mode
"layer_pipeline", layer_pipeline.py): exact full-graph training, the nodes flowing through the stages in chunks.

`autopar.plan` / `autopar.compile` route graph models here (planner.graph_kind); see docs/architecture.md.
"""

from __future__ import annotations

from .data import IGNORE, GraphData, locality_order, random_graph
from .models import GRAPH_CASES
from .partitioners import PARTITIONERS, metis_parts, partition_quality
from .planner import graph_kind, plan_graph
from .program import GraphProgram, TemporalProgram
from .sampling import sampled_graph, seeds_for_step
from .store import write_parts as partition
from .tgn import TGN, random_events

__all__ = ["GRAPH_CASES", "IGNORE", "PARTITIONERS", "TGN", "GraphData", "GraphProgram", "TemporalProgram",
           "graph_kind", "locality_order", "metis_parts", "partition", "partition_quality", "plan_graph",
           "random_events", "random_graph", "sampled_graph", "seeds_for_step"]
