"""A cluster file's top-level `links` list: measured link figures per link kind or per node pair.

The format is in autopar/cluster.py's docstring; `autopar probe` (autopar/runtime/probe.py) writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .errors import ClusterError

if TYPE_CHECKING:
    from .cluster import Link, Node


def measured_links(entries: Any, where: str, nodes: list[Node], network: Link, make_link: Callable[..., Link]
                   ) -> tuple[list[Node], Link, tuple[tuple[tuple[int, int], Link], ...]]:
    """Apply a file's top-level `links` (module docstring): per-kind entries replace every link of that kind,
    per-node-pair entries become `Cluster.pair_links`."""
    if entries is None:
        return nodes, network, ()
    if not isinstance(entries, list):
        raise ClusterError(f"{where} must be a list of {{kind: ..}} or {{nodes: [a, b], ..}} entries with "
                           f"bandwidth_GBps and latency_us, got {entries!r}.")
    pairs: dict[tuple[int, int], Link] = {}
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(e, dict) or ("kind" not in e and "nodes" not in e):
            raise ClusterError(f"{at} must be a mapping with either 'kind' (a link kind such as NVLink3: every "
                               f"link of that kind) or 'nodes' ([a, b], global node indices), got {e!r}.")
        fields = {k: v for k, v in e.items() if k != "nodes"}
        link = make_link({"measured": True, **fields}, at, None)
        if "nodes" not in e:
            kind = str(e["kind"])
            nodes = [replace(n, intra_node=link) if n.intra_node.kind == kind else n for n in nodes]
            network = link if network.kind == kind else network
            continue
        pair = e["nodes"]
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(nodes) for x in pair)):
            raise ClusterError(f"{at}.nodes must be [a, b], two node indices in 0..{len(nodes) - 1}, got {pair!r}.")
        key = (min(pair), max(pair))
        if key in pairs:
            raise ClusterError(f"{at} gives nodes {list(key)} a second time; give each node pair once.")
        pairs[key] = link
    return nodes, network, tuple(sorted(pairs.items()))


__all__ = ["measured_links"]
