"""NCCL's tuning model, simplified: what a collective among GPUs costs as NCCL runs it.

NCCL prices every (algorithm, protocol) pair of a collective as ``latency + bytes / algorithm bandwidth`` and
runs the cheapest (``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime`` in NCCL's src/graph/tuning.cc; the
constants below are that file's at NCCL commit 01afd20, the 2.8 series, the first with Ampere figures).
This module keeps that structure and its constants, and replaces NCCL's topology search (channels, graphs)
by two *paths*: the intra-node ring edges and the inter-node (network) edges of the group.

Per algorithm a and protocol P, with p ranks on m nodes:

    ring    lat = base[a][P] + (nsteps - ninter) * intra_lat[a][P] + ninter * inter_lat[a][P]
            nsteps = 2(p-1) (all_reduce), p-1 (all_gather, reduce_scatter, broadcast)
            ninter = 2(m-1) (all_reduce), m-1 (others)
            time = lat + n / (busbw_P * p / nsteps)
    tree    (all_reduce) lat = base + 2 ((p/m - 1) intra_lat + log2(m) inter_lat)   intra chain + inter tree
            time = lat + n / (busbw_P * 0.5 * correction(n))
    p2p     lat = base[ring][P] + one ring step's latency;  time = lat + n / busbw_P

With several nodes, LL's intra-node step latency counts x1.8 (NCCL). busbw_P is the path's achieved bus
bandwidth (the bottleneck of the intra and inter paths) times NCCL's protocol factor: LL moves 4 data
bytes per 8 (ring all_reduce x1/4, other ring collectives x1/3, tree x1/3.8; p2p sends x1/3), LL128
120 of 128 (x0.92, NVLink inside one node only: NCCL enables it only there), Simple x1; tree caps
busbw at 0.9 x busbw and at 110 GB/s (2 nodes or fewer) / 80 GB/s (more).

Each link's step latency is NCCL's hwLat for its hardware class (NVLink, PCI, NET), plus whatever the
cluster file's latency exceeds the catalog's figure for that class (`REFERENCE_LATENCY_S`): a catalog link
reproduces NCCL's table, a declared 100 us Ethernet pays 95 us more per step. A *measured* link
(`Link.measured`, written by `autopar probe`) already is an achieved ring step: its latency is the step
latency and its bandwidth the bus bandwidth, for every protocol, with no base latency on top.

Achieved bandwidth of a datasheet link = datasheet bandwidth x `LINK_EFFICIENCY` of its kind (sources
beside each figure). Simplifications (documented, not NCCL): no channel count (so no per-channel LL128
cap), no CollNet/NVLS/PAT algorithms (NCCL >= 2.17 on NVSwitch H100 can beat the ring with NVLS), the
broadcast latency counts p-1 ring steps, and a symbolic byte count leaves out the size-dependent tree
correction and ring plateau.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..catalog import Link

PROTOCOLS = ("LL", "LL128", "Simple")

# NCCL src/graph/tuning.cc (commit 01afd20): baseLat[algo][proto], microseconds.
BASE_LAT_US = {"tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0},
               "ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}}
# NCCL src/graph/tuning.cc (commit 01afd20): hwLat[hw][algo][proto], microseconds per step.
HW_LAT_US = {
    "nvlink": {"tree": {"LL": 0.52, "LL128": 1.2, "Simple": 28.0}, "ring": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4}},
    "pci": {"tree": {"LL": 1.0, "LL128": 1.9, "Simple": 28.0}, "ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7}},
    "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0}, "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}},
}
# NCCL src/graph/tuning.cc (commit 01afd20): treeCorrectionFactor[proto][log2(bytes / 64)], 64 B .. 128 MiB.
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# NCCL src/graph/tuning.cc (commit 01afd20): tree busbw caps (GB/s) and the A100 (compCap 80) busbw cap.
MAX_TREE_BUSBW = {"two_nodes_or_fewer": 110e9, "more_nodes": 80e9}
NVLINK3_BUSBW_CAP = 235e9  # `if (compCap80) busBw = std::min(busBw, 235.0f)`
RING_PLATEAU = 1.9  # ring/Simple all_reduce over several nodes, n >= p/16 * 64 KiB: latency x 1.9 (tuning.cc)

# Achieved fraction of a link's datasheet one-direction bandwidth, by hardware kind.
LINK_EFFICIENCY = {
    # NCCL src/graph/topo.h: SM70_NVLINK_BW = SM80_NVLINK_BW = 20 GB/s per NVLink vs 25 GB/s per link and
    # direction on the V100 (NVLink2) and A100 (NVLink3) datasheets. Cross-check, nccl-tests busbw at large
    # sizes on 8 x A100 NVSwitch boards: ~200-208 GB/s (NVIDIA/nccl-tests#149, #178) of 300 GB/s.
    "nvlink": 20.0 / 25.0,
    # NCCL src/graph/topo.h: SM90_NVLINK_BW = 20.6 GB/s per NVLink4 link vs 25 GB/s (H100 datasheet: 18 links,
    # 450 GB/s each way).
    "nvlink4": 20.6 / 25.0,
    # NCCL src/graph/topo.h: PCI_BW = 12 GB/s for PCIe Gen3 x16 (16 GB/s nominal); the same fraction is
    # assumed for Gen4/Gen5 (engineering estimate: same 128b/130b coding and TLP overheads).
    "pci": 12.0 / 16.0,
    # NCCL src/graph/topo.h: NET_BW = 12 GB/s for a 100 Gb/s (12.5 GB/s) NIC. Cross-check: nccl-tests on
    # 3 nodes x 8 A100 with 4 HDR NICs peaks at 96 of 100 GB/s busbw (NVIDIA/nccl-tests#119).
    "ib": 12.0 / 12.5,
    # NCCL's socket transport over TCP/IP Ethernet: engineering estimate (TCP/IP headers ~3 % at 1500 B MTU,
    # plus the host copy NCCL's socket transport makes); run `autopar probe` for the real figure.
    "socket": 0.85,
}
# The catalog's latency per hardware class (autopar/catalog.py): a link's latency above it adds to each step.
REFERENCE_LATENCY_S = {"nvlink": 2e-6, "pci": 5e-6, "net": 5e-6}


@dataclass(frozen=True)
class Path:
    """One kind of ring edge (intra-node or network) as NCCL's model sees it.

    hw: "nvlink" | "pci" | "net" (NCCL's hwLat row); busbw: achieved Simple-protocol bus bandwidth, bytes/s;
    extra_latency: seconds per step beyond NCCL's table; measured: figures are an achieved ring step."""

    hw: str
    busbw: float
    extra_latency: float = 0.0
    measured: bool = False
    ll128: bool = False  # NVLink: NCCL enables the LL128 protocol on it

    def step_latency(self, algorithm: str, protocol: str) -> float:
        if self.measured:
            return self.extra_latency
        return HW_LAT_US[self.hw][algorithm][protocol] * 1e-6 + self.extra_latency


def link_class(link: Link, network: bool) -> tuple[str, str]:
    """(NCCL hardware row, efficiency key) of a link from its kind. A network link of no kind is the
    catalog's default, InfiniBand HDR."""
    kind = link.kind.lower().replace("-", "").replace(" ", "")
    if kind.startswith("nvlink"):
        return "nvlink", "nvlink4" if kind.startswith(("nvlink4", "nvlink5")) else "nvlink"
    if kind.startswith("pci"):
        return "pci", "pci"
    if network:
        if kind.startswith(("ethernet", "eth", "tcp", "socket", "wifi", "gbe")):
            return "net", "socket"
        return "net", "ib"  # "", IB*, InfiniBand*, RoCE*, EFA: RDMA networks
    return "pci", "pci"


def path(link: Link, network: bool, bandwidth: float | None = None) -> Path:
    """The Path of a link; `bandwidth` (bytes/s, datasheet or measured) replaces the link's own, e.g. a
    NIC share."""
    bw = link.bandwidth if bandwidth is None else bandwidth
    hw, eff_key = link_class(link, network)
    if link.measured:
        return Path(hw, bw, link.latency, measured=True)
    busbw = bw * LINK_EFFICIENCY[eff_key]
    if link.kind.lower().replace("-", "").startswith("nvlink3"):
        busbw = min(busbw, NVLINK3_BUSBW_CAP)
    return Path(hw, busbw, max(0.0, link.latency - REFERENCE_LATENCY_S[hw]), ll128=hw == "nvlink" and not network)


def _protocol_busbw(kind: str, algorithm: str, protocol: str, busbw: float, multi_node: bool,
                    nodes: int) -> float:
    if protocol == "LL":
        if algorithm == "tree":
            return busbw / 3.8
        return busbw / 4.0 if multi_node or kind == "all_reduce" else busbw / 3.0
    if protocol == "LL128":
        return busbw * (0.92 if algorithm == "ring" else (7.0 / 9.0 if nodes == 1 else 0.915))
    return busbw


def _protocols(intra: Path, inter: Path | None) -> tuple[str, ...]:
    if intra.measured and (inter is None or inter.measured):
        return ("Simple",)  # measured figures do not depend on the protocol
    return PROTOCOLS if inter is None and intra.ll128 else ("LL", "Simple")


def _base(algorithm: str, protocol: str, intra: Path, inter: Path | None) -> float:
    if intra.measured and (inter is None or inter.measured):
        return 0.0
    return BASE_LAT_US[algorithm][protocol] * 1e-6


def ring_time(kind: str, n: Any, p: int, m: int, intra: Path, inter: Path | None,
              numeric: bool = True) -> list[tuple[Any, str]]:
    """[(seconds, protocol)] of a ring collective of `n` bytes over p ranks on m nodes (module docstring)."""
    nsteps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    ninter = (2 * (m - 1) if kind == "all_reduce" else m - 1) if inter is not None else 0
    busbw = intra.busbw if inter is None else min(intra.busbw, inter.busbw)
    out = []
    for proto in _protocols(intra, inter):
        intra_lat = intra.step_latency("ring", proto) * _ll_intra_factor(proto, intra, inter)
        lat = _base("ring", proto, intra, inter) + (nsteps - ninter) * intra_lat
        if inter is not None:
            lat += ninter * inter.step_latency("ring", proto)
            plateau = (numeric and kind == "all_reduce" and proto == "Simple" and not inter.measured
                       and n >= p / 16.0 * 65536)
            lat *= RING_PLATEAU if plateau else 1.0
        bw = _protocol_busbw(kind, "ring", proto, busbw, inter is not None, m)
        ratio = 1.0 if kind == "broadcast" else p / nsteps
        out.append((lat + n / (bw * ratio), proto))
    return out


def tree_time(kind: str, n: Any, p: int, m: int, intra: Path, inter: Path | None,
              numeric: bool = True) -> list[tuple[Any, str]]:
    """[(seconds, protocol)] of NCCL's tree: a chain inside each node, a double binary tree across nodes.
    all_reduce goes up and down (2 passes); broadcast down only (1 pass)."""
    passes = 2 if kind == "all_reduce" else 1
    busbw = intra.busbw if inter is None else min(intra.busbw, inter.busbw)
    measured = intra.measured and (inter is None or inter.measured)
    if not measured:
        busbw = min(0.9 * busbw, MAX_TREE_BUSBW["two_nodes_or_fewer" if m <= 2 else "more_nodes"])
    per_node = p // m
    out = []
    for proto in _protocols(intra, inter):
        intra_lat = intra.step_latency("tree", proto) * _ll_intra_factor(proto, intra, inter)
        lat = (per_node - 1) * intra_lat
        if inter is not None:
            lat += (m - 1).bit_length() * inter.step_latency("tree", proto)  # ceil(log2 m) levels
        lat = _base("tree", proto, intra, inter) + passes * lat
        bw = _protocol_busbw(kind, "tree", proto, busbw, inter is not None, m) / passes
        if numeric and not measured:
            bw *= _tree_correction(proto, float(n))
        out.append((lat + n / bw, proto))
    return out


def p2p_time(n: Any, link: Path) -> list[tuple[Any, str]]:
    """[(seconds, protocol)] of one send/recv over a link: NCCL's per-operation base latency plus one ring
    step, at the protocol's bandwidth (the per-message setup a send pays; the one-time connection setup is
    not priced, it is paid once per peer in a run)."""
    out = []
    for proto in _protocols(link, None) if link.measured else ("LL", "Simple"):
        lat = _base("ring", proto, link, None) + link.step_latency("ring", proto)
        out.append((lat + n / _protocol_busbw("p2p", "ring", proto, link.busbw, False, 1), proto))
    return out


def _ll_intra_factor(protocol: str, intra: Path, inter: Path | None) -> float:
    """NCCL: with several nodes, LL's intra-node step latency x 1.8 (tuning.cc, `intraLat *= 1.8`)."""
    return 1.8 if inter is not None and protocol == "LL" and not intra.measured else 1.0


def _tree_correction(protocol: str, n: float) -> float:
    chunks = int(n) >> 6
    log = chunks.bit_length() - 1 if chunks > 0 else 0
    table = TREE_CORRECTION[protocol]
    return table[log] if log < len(table) else 1.0


def best(options: list[tuple[Any, str]]) -> tuple[Any, str]:
    """The cheapest (seconds, protocol) of numeric options."""
    return min(options, key=lambda t: t[0])


def busbw_of(kind: str, n: float, p: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of a collective that took `seconds` (its PERFORMANCE.md factors)."""
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}
    return n * factor.get(kind, 1.0) / seconds if seconds > 0 else math.inf


__all__ = ["BASE_LAT_US", "HW_LAT_US", "LINK_EFFICIENCY", "PROTOCOLS", "Path", "best", "busbw_of",
           "link_class", "p2p_time", "path", "ring_time", "tree_time"]
