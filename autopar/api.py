"""Public entry points: analyze (and, as they land, plan / estimate / compile)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .cluster import Cluster
from .graph import TrainingGraph
from .passes.annotate import annotate
from .passes.capture import LossFn, capture
from .report import dump_graph


def analyze(model: nn.Module, cluster: Cluster | str | dict | os.PathLike, example_inputs: tuple = (),
            example_target: Any = None, loss_fn: LossFn | None = None, precision: str = "fp32",
            dump_dir: str | os.PathLike | None = None) -> TrainingGraph:
    """Capture `model` on one global batch and cost every node on every device type of `cluster`.

    Returns the annotated TrainingGraph; `graph.table()` prints it. With AUTOPAR_DUMP=<dir> (or
    `dump_dir=`) also writes graph.txt, graph.json and graph.dot there.
    """
    cluster = Cluster.load(cluster)
    graph = annotate(capture(model, example_inputs, loss_fn, example_target), cluster, precision=precision)
    dump_graph(graph, dump_dir)
    return graph
