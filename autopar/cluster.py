"""Cluster descriptions: device specs, links, and the global device order used for ranks.

A cluster is loaded from a YAML/JSON file, a dict of the same shape, or a shorthand string
("2x8xA100-80GB+1x4xV100-16GB"). Device `i` of the cluster (file order: node groups, then nodes,
then devices within a node) is rank `i` of every program autopar generates.

Links. Every link mapping is ``{bandwidth_GBps, latency_us, kind, measured}``: one-direction bandwidth per
device and per-message latency. A catalog or hand-written link holds datasheet figures; the comm model
(cost_models/comm.py, cost_models/nccl.py) derates them to what NCCL achieves on that kind of link.
``measured: true`` says the figures are achieved ones (what `autopar probe` writes): bandwidth is the bus
bandwidth of a ring step (nccl-tests' busbw) and latency the time of one ring step, taken as they are.
Measured figures may also be given apart from the node groups, in a top-level ``links`` list:

    links:
      - {kind: NVLink3, bandwidth_GBps: 231, latency_us: 4.1}          # every link of this kind
      - {nodes: [0, 1], bandwidth_GBps: 22.8, latency_us: 9.5}          # the network between nodes 0 and 1
      - {nodes: [2, 2], bandwidth_GBps: 19.5, latency_us: 6.0}          # node 2's intra-node link

(node indices are global, in file order; entries here are measured unless they say ``measured: false``).
A node group's ``nic_GBps`` is the network bandwidth one node's NICs carry in all (one direction); groups
that cross the network at once share it (default: devices_per_node x the network's per-device figure,
one NIC share per device, so sharing never bites unless a file says its nodes have fewer NICs).

Prices. A node group's ``price_per_hour`` is what one of its DEVICES costs per hour (a cloud instance's
price divided by its GPUs; any currency, the same in the whole file). With prices on every group the plan
predicts ``cost_per_hour`` (of the devices it uses) and ``cost_per_sample``, and `autopar.plan(...,
objective="cost")` looks for the lowest cost per sample, `budget_per_hour=` for the fastest plan within a
budget (solver/search/objective.py). Without it a group has no price; the "cost" objective then raises PlanError.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .catalog import ALIASES, CATALOG, DEFAULT_NETWORK, EDGE_NETWORK, DeviceSpec, GiB, Link
from .cluster_files import read_file as _read_file
from .cluster_links import measured_links
from .errors import ClusterError, close_matches
from .host_memory import UNIFIED_KINDS, default_host_memory, total_ram


@dataclass(frozen=True)
class Device:
    index: int  # global index = rank
    node: int  # global node index
    local_rank: int  # index within its node
    spec: DeviceSpec


@dataclass(frozen=True)
class Node:
    index: int
    group: int  # node group in the file
    devices: tuple[int, ...]
    intra_node: Link
    host_memory: int  # bytes of host (CPU) memory the node's devices offload to (host_memory.py)
    nic_bandwidth: float | None = None  # bytes/s all its NICs carry (one direction); None: a share per device
    price_per_hour: float | None = None  # what one of its devices costs per hour (module docstring); None: unpriced


@dataclass(frozen=True)
class Cluster:
    devices: tuple[Device, ...]
    nodes: tuple[Node, ...]
    network: Link
    name: str = "cluster"
    source: dict = field(default_factory=dict, compare=False, repr=False)
    pair_links: tuple[tuple[tuple[int, int], Link], ...] = ()  # measured links per node pair (a <= b)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pairs", dict(self.pair_links))

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def load(x: str | os.PathLike | dict | Cluster) -> Cluster:
        """Load from a YAML/JSON path, a dict of the file's shape, or a shorthand string."""
        if isinstance(x, Cluster):
            return x
        if isinstance(x, dict):
            return _from_dict(x, where="cluster")
        if isinstance(x, os.PathLike) or (isinstance(x, str) and _looks_like_path(x)):
            return _from_dict(_read_file(Path(x)), where=str(x))
        if isinstance(x, str):
            return _from_dict(parse_shorthand(x), where=f"shorthand {x!r}")
        raise ClusterError(
            f"Cluster.load() takes a file path, a dict or a shorthand string like '1x8xA100-80GB', "
            f"not {type(x).__name__}."
        )

    @staticmethod
    def local() -> Cluster:
        """The machine this runs on: its CUDA GPUs, or the CPU as one device."""
        import torch

        if torch.cuda.is_available():
            names = [catalog_name_for_gpu(torch.cuda.get_device_name(i), i)
                     for i in range(torch.cuda.device_count())]
            groups: list[dict] = []
            for n in names:
                if groups and groups[-1]["device"] == n:
                    groups[-1]["devices_per_node"] += 1
                else:
                    # this machine's RAM, measured, rather than a typical server's
                    groups.append({"device": n, "devices_per_node": 1, "host_memory_GiB": total_ram() / GiB})
            c = _from_dict({"name": "local", "nodes": groups}, where="local")
            if len(groups) == 1:
                return c
            # Mixed GPUs in one box: still one node (a file cannot say so), linked at its slowest link.
            links = [n.intra_node for n in c.nodes]
            slow = Link(min(x.bandwidth for x in links), max(x.latency for x in links),
                        min(links, key=lambda x: x.bandwidth).kind)
            devices = tuple(Device(d.index, 0, d.index, d.spec) for d in c.devices)
            node = Node(0, 0, tuple(range(len(devices))), slow, c.nodes[0].host_memory)
            return Cluster(devices, (node,), c.network, "local", source=c.source)
        cpu = {"name": "local", "nodes": [{"device": "cpu", "devices_per_node": 1}]}
        return _from_dict(cpu, where="local")

    # ---- queries ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.devices)

    def device_types(self) -> list[str]:
        """Distinct device type names, in order of first appearance."""
        seen: dict[str, None] = {}
        for d in self.devices:
            seen.setdefault(d.spec.name, None)
        return list(seen)

    def spec(self, type_name: str) -> DeviceSpec:
        for d in self.devices:
            if d.spec.name == type_name:
                return d.spec
        raise ClusterError(f"no device of type {type_name!r} in cluster {self.name!r}; "
                           f"it has {self.device_types()}")

    def same_node(self, i: int, j: int) -> bool:
        return self.devices[i].node == self.devices[j].node

    def link(self, i: int, j: int) -> Link:
        """The link data takes from device i to device j (intra-node or the network; a measured node-pair
        link where the file gives one)."""
        a, b = self.devices[i].node, self.devices[j].node
        if self._pairs:  # type: ignore[attr-defined]
            hit = self._pairs.get((a, b) if a <= b else (b, a))  # type: ignore[attr-defined]
            if hit is not None:
                return hit
        return self.nodes[a].intra_node if a == b else self.network

    def nic_bandwidth(self, node: int) -> float:
        """Bytes/s one direction all NICs of `node` carry: its `nic_GBps`, else one network share per device."""
        n = self.nodes[node]
        return n.nic_bandwidth if n.nic_bandwidth is not None else len(n.devices) * self.network.bandwidth

    def price_per_hour(self, device: int) -> float | None:
        """What device `device` costs per hour (its node group's `price_per_hour`), None when unpriced."""
        return self.nodes[self.devices[device].node].price_per_hour

    def subset(self, indices: list[int] | tuple[int, ...], name: str | None = None) -> Cluster:
        """The cluster made of the given devices (re-indexed in the given order)."""
        indices = list(indices)
        if not indices:
            raise ClusterError("subset() needs at least one device index.")
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.world_size:
                raise ClusterError(f"subset(): device index {i!r} is not in 0..{self.world_size - 1} "
                                   f"of cluster {self.name!r}.")
        if len(set(indices)) != len(indices):
            raise ClusterError(f"subset(): device indices repeat in {indices}; give each device once.")
        devices, nodes, node_map = [], [], {}
        for new_i, old_i in enumerate(indices):
            d = self.devices[old_i]
            if d.node not in node_map:
                old = self.nodes[d.node]
                node_map[d.node] = len(nodes)
                nodes.append(Node(len(nodes), old.group, (), old.intra_node, old.host_memory, old.nic_bandwidth,
                                  old.price_per_hour))
            n = node_map[d.node]
            local = len(nodes[n].devices)
            nodes[n] = replace(nodes[n], devices=nodes[n].devices + (new_i,))
            devices.append(Device(new_i, n, local, d.spec))
        # Renumber node groups the way to_dict() + load() would: consecutive alike nodes of one old group.
        prev, key, gid = None, None, -1
        for k, node in enumerate(nodes):
            key = (node.group, len(node.devices), devices[node.devices[0]].spec, node.intra_node,
                   node.host_memory, node.nic_bandwidth, node.price_per_hour)
            if key != prev:
                gid += 1
            prev = key
            nodes[k] = replace(node, group=gid)
        pairs = tuple(((min(node_map[a], node_map[b]), max(node_map[a], node_map[b])), link)
                      for (a, b), link in self.pair_links if a in node_map and b in node_map)
        return Cluster(tuple(devices), tuple(nodes), self.network, name or f"{self.name}-subset",
                       pair_links=tuple(sorted(pairs, key=lambda e: e[0])))

    def to_dict(self) -> dict:
        """A dict that `Cluster.load` turns back into an equal cluster (custom specs inlined)."""
        groups: list[dict] = []
        last_group, next_index = None, 0
        for node in self.nodes:
            spec = self.devices[node.devices[0]].spec
            if any(self.devices[i].spec != spec for i in node.devices):
                raise ClusterError("a node holding several device types cannot be written as a cluster file")
            if node.devices != tuple(range(next_index, next_index + len(node.devices))):
                raise ClusterError(f"node {node.index}'s devices {node.devices} do not follow the previous "
                                   f"node's; a cluster file numbers devices node by node, so this rank order "
                                   f"cannot be written as one.")
            next_index += len(node.devices)
            entry = {"device": spec.to_dict(), "devices_per_node": len(node.devices), "count": 1,
                     "intra_node": node.intra_node.to_dict(), "host_memory_GiB": node.host_memory / GiB}
            if node.nic_bandwidth is not None:
                entry["nic_GBps"] = node.nic_bandwidth / 1e9
            if node.price_per_hour is not None:
                entry["price_per_hour"] = node.price_per_hour
            last = groups[-1] if groups else None
            if last and node.group == last_group and {k: v for k, v in last.items() if k != "count"} == {
                    k: v for k, v in entry.items() if k != "count"}:
                last["count"] += 1
            else:
                groups.append(entry)
            last_group = node.group
        out = {"name": self.name, "nodes": groups, "network": self.network.to_dict()}
        if self.pair_links:
            out["links"] = [{"nodes": list(pair), **link.to_dict()} for pair, link in self.pair_links]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> str:
        parts = []
        for node in self.nodes:
            spec = self.devices[node.devices[0]].spec
            parts.append(f"{len(node.devices)}x{spec.name}")
        return f"{self.name}: {self.world_size} devices in {len(self.nodes)} nodes ({', '.join(parts)})"


# ---- parsing ------------------------------------------------------------------------------

_SHORTHAND_GROUP = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*([A-Za-z0-9_.\-]+)\s*$")


def _looks_like_path(s: str) -> bool:
    if s.endswith((".yaml", ".yml", ".json")) or os.sep in s:
        return True
    try:
        return Path(s).is_file()
    except OSError:  # e.g. a shorthand longer than the file-name limit
        return False


def parse_shorthand(s: str) -> dict:
    """'2x8xA100-80GB+1x4xV100-16GB' -> the equivalent cluster dict."""
    groups = []
    for part in s.split("+"):
        m = _SHORTHAND_GROUP.match(part)
        if not m:
            raise ClusterError(
                f"cannot read cluster shorthand part {part.strip()!r} of {s!r}: expected "
                f"NODESxDEVICESxTYPE groups joined by '+', e.g. '2x8xA100-80GB+1x4xV100-16GB'."
            )
        groups.append({"device": m.group(3), "devices_per_node": int(m.group(2)), "count": int(m.group(1))})
    return {"name": s, "nodes": groups}


_TOP_KEYS = ("name", "nodes", "network", "links")
_GROUP_KEYS = ("device", "devices_per_node", "count", "intra_node", "host_memory_GiB", "nic_GBps", "price_per_hour")
_LINK_KEYS = ("bandwidth_GBps", "latency_us", "kind", "measured")
_DEVICE_KEYS = ("name", "based_on", "tflops_fp32", "tflops_tf32", "tflops_bf16", "tflops_fp16", "memory_GiB",
                "memory_bandwidth_GBps", "intra_node", "host_link", "kind")


def _check_typos(m: dict, known: tuple[str, ...], where: str) -> None:
    """Reject a key that looks like a misspelling of a known key the mapping lacks (it would be ignored).

    Other extra keys are allowed (comments, site-specific fields)."""
    missing = [k for k in known if k not in m]
    for key in m:
        if key in known or not isinstance(key, str):
            continue
        near = difflib.get_close_matches(key.lower(), [k.lower() for k in missing], n=1, cutoff=0.75)
        if near:
            fix = next(k for k in missing if k.lower() == near[0])
            raise ClusterError(f"{where} has unknown key {key!r}; did you mean {fix!r}? Known keys here: "
                               f"{', '.join(known)}.")


def _number(value: Any, where: str, *, positive: bool = True, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} must be a number, got {value!r}.")
    if value != value or value in (float("inf"), float("-inf")):
        raise ClusterError(f"{where} must be finite, got {value!r}.")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ClusterError(f"{where} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}.")
    return float(value)


def _link(d: Any, where: str, default: dict | None) -> Link:
    if d is None:
        if default is None:
            raise ClusterError(f"{where} is missing: give {{bandwidth_GBps: ..., latency_us: ...}}.")
        d = default
    if not isinstance(d, dict):
        raise ClusterError(f"{where} must be a mapping like {{bandwidth_GBps: 25, latency_us: 5}}, "
                           f"got {d!r}.")
    _check_typos(d, _LINK_KEYS, where)
    if "bandwidth_GBps" not in d:
        if default is None or "latency_us" not in d:
            raise ClusterError(f"{where}.bandwidth_GBps is missing: give the link's one-direction "
                               f"bandwidth in GB/s.")
        d = {**default, **d}
    bw = _number(d["bandwidth_GBps"], f"{where}.bandwidth_GBps")
    lat = _number(d.get("latency_us", (default or {}).get("latency_us", 5.0)), f"{where}.latency_us",
                  allow_zero=True)
    measured = d.get("measured", False)
    if not isinstance(measured, bool):
        raise ClusterError(f"{where}.measured must be true or false, got {measured!r}.")
    # Divide, not multiply by 1e-6: then latency_us -> s -> us -> s is exact and to_dict() round-trips.
    return Link(bw * 1e9, lat / 1e6, str(d.get("kind", "")), measured)


def resolve_device_name(name: str, where: str = "") -> str:
    """Canonical catalog name for a user-typed device name, or a ClusterError listing close matches (naming
    `where` it was read: the cluster file and key path)."""
    if name in CATALOG or name == "cpu":
        return name
    canon = {k.lower(): k for k in CATALOG}
    key = name.lower().replace("_", "-")
    if key in canon:
        return canon[key]
    alias = {k.lower(): v for k, v in ALIASES.items()}
    if key.replace("-", "") in {a.replace("-", "") for a in alias}:
        for a, v in alias.items():
            if a.replace("-", "") == key.replace("-", ""):
                return v
    if key == "cpu":
        return "cpu"
    known = sorted(CATALOG) + ["cpu"]
    raise ClusterError(f"{where + ': ' if where else ''}unknown device type {name!r}."
                       f"{close_matches(name, known)} Known types: "
                       f"{', '.join(known)}; or define a custom device as a mapping with name, tflops_fp32, "
                       f"tflops_bf16, memory_GiB and memory_bandwidth_GBps.")


def device_spec(entry: Any, where: str = "device") -> DeviceSpec:
    """A DeviceSpec from a catalog name or a custom mapping (optionally `based_on` a catalog name)."""
    if isinstance(entry, str):
        name = resolve_device_name(entry, where)
        if name == "cpu":
            from .cost_models.host import cpu_spec

            # Through the same unit conversions as a file, so Cluster.load(c.to_dict()) == c exactly.
            return _spec_from_mapping(cpu_spec().to_dict(), where)
        return _spec_from_mapping({"name": name, **CATALOG[name]}, where)
    if isinstance(entry, dict):
        _check_typos(entry, _DEVICE_KEYS, where)
        base: dict = {}
        if "based_on" in entry:
            bname = resolve_device_name(str(entry["based_on"]), f"{where}.based_on")
            base = device_spec(bname).to_dict() if bname == "cpu" else {"name": bname, **CATALOG[bname]}
        elif entry.get("name") and not ({"tflops_fp32", "memory_GiB"} & set(entry)):
            try:
                bname = resolve_device_name(str(entry["name"]))
            except ClusterError:
                bname = None  # a custom device missing fields: _spec_from_mapping says which
            if bname:
                base = device_spec(bname).to_dict() if bname == "cpu" else {"name": bname, **CATALOG[bname]}
        return _spec_from_mapping({**base, **entry}, where)
    raise ClusterError(f"{where} must be a catalog name like 'A100-80GB' or a mapping defining a custom "
                       f"device, got {entry!r}.")


_PCIE3_DEFAULT = {"bandwidth_GBps": 16.0, "latency_us": 5.0}  # a custom device's links unless it gives them


def _spec_from_mapping(m: dict, where: str) -> DeviceSpec:
    for key in ("name", "tflops_fp32", "memory_GiB", "memory_bandwidth_GBps"):
        if key not in m:
            hint = close_matches(str(m["name"]), list(CATALOG) + ["cpu"]) if "name" in m else ""
            raise ClusterError(f"custom {where} is missing {key!r}; a custom device needs name, tflops_fp32, "
                               f"tflops_bf16, memory_GiB, memory_bandwidth_GBps (or based_on: <catalog "
                               f"name>)." + (f" For a catalog device give its name as a string.{hint}"
                                             if hint else ""))
    fp32 = _number(m["tflops_fp32"], f"{where}.tflops_fp32")
    tf32 = _number(m.get("tflops_tf32", fp32), f"{where}.tflops_tf32")
    # tflops_bf16 None (the catalog's Volta/Turing boards): no bf16; absent: runs bf16 at the fp32 rate
    bf16 = None if m.get("tflops_bf16", fp32) is None else _number(m.get("tflops_bf16", fp32),
                                                                    f"{where}.tflops_bf16")
    fp16 = _number(m.get("tflops_fp16", fp32 if bf16 is None else bf16), f"{where}.tflops_fp16")
    kind = str(m.get("kind", "gpu"))
    return DeviceSpec(
        name=str(m["name"]),
        peak_flops={"fp32": fp32 * 1e12, "tf32": tf32 * 1e12, "fp16": fp16 * 1e12,
                    **({} if bf16 is None else {"bf16": bf16 * 1e12})},
        memory=int(_number(m["memory_GiB"], f"{where}.memory_GiB") * GiB),
        memory_bandwidth=_number(m["memory_bandwidth_GBps"], f"{where}.memory_bandwidth_GBps") * 1e9,
        intra_node=_link(m.get("intra_node"), f"{where}.intra_node", _PCIE3_DEFAULT),
        host_link=_link(m.get("host_link"), f"{where}.host_link", _PCIE3_DEFAULT),
        kind=kind,
    )


def _from_dict(d: dict, where: str) -> Cluster:
    if not isinstance(d, dict):
        raise ClusterError(f"{where}: a cluster must be a mapping with a 'nodes' list.")
    _check_typos(d, _TOP_KEYS, where)
    groups = d.get("nodes")
    if not isinstance(groups, list) or not groups:
        raise ClusterError(f"{where}: 'nodes' must be a non-empty list of node groups, e.g. "
                           f"[{{device: A100-80GB, devices_per_node: 8, count: 2}}].")
    devices: list[Device] = []
    nodes: list[Node] = []
    for g_i, g in enumerate(groups):
        gw = f"{where}: nodes[{g_i}]"
        if not isinstance(g, dict):
            raise ClusterError(f"{gw} must be a mapping with 'device' and 'devices_per_node', got {g!r}.")
        _check_typos(g, _GROUP_KEYS, gw)
        if "device" not in g:
            raise ClusterError(f"{gw} has no 'device': name a catalog type (see `autopar devices`) "
                               f"or define one.")
        spec = device_spec(g["device"], f"{gw}.device")
        per = g.get("devices_per_node", 1)
        count = g.get("count", 1)
        for key, val in (("devices_per_node", per), ("count", count)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ClusterError(f"{gw}.{key} must be a positive integer, got {val!r}.")
        intra = _link(g.get("intra_node"), f"{gw}.intra_node", spec.intra_node.to_dict())
        host = _host_memory(g, gw, spec, per)
        nic = None if g.get("nic_GBps") is None else _number(g["nic_GBps"], f"{gw}.nic_GBps") * 1e9
        price = None if g.get("price_per_hour") is None else _number(
            g["price_per_hour"], f"{gw}.price_per_hour (what one device of the group costs per hour)", allow_zero=True)
        for _ in range(count):
            idx = tuple(range(len(devices), len(devices) + per))
            nodes.append(Node(len(nodes), g_i, idx, intra, host, nic, price))
            devices.extend(Device(i, len(nodes) - 1, k, spec) for k, i in enumerate(idx))
    default_net = EDGE_NETWORK if all(dev.spec.kind == "edge" for dev in devices) else DEFAULT_NETWORK
    network = _link(d.get("network"), f"{where}: network", default_net)
    nodes, network, pairs = measured_links(d.get("links"), f"{where}: links", nodes, network, _link)
    return Cluster(tuple(devices), tuple(nodes), network, str(d.get("name") or "cluster"), source=d,
                   pair_links=pairs)


def _host_memory(g: dict, where: str, spec: DeviceSpec, per: int) -> int:
    """Bytes of host memory of one node of group `g`: its `host_memory_GiB`, else the default for its
    device type (host_memory.py)."""
    if g.get("host_memory_GiB") is None:
        dev = g["device"]
        based_on = str(dev.get("based_on")) if isinstance(dev, dict) and dev.get("based_on") else None
        return default_host_memory(spec.name, spec.kind, spec.memory, per, based_on)
    return int(_number(g["host_memory_GiB"], f"{where}.host_memory_GiB (GiB of CPU memory per node)",
                       allow_zero=True) * GiB)


def catalog_name_for_gpu(name: str, index: int) -> str | dict:
    """Map a CUDA device name ('NVIDIA A100-SXM4-80GB') to a catalog entry, else a custom spec.

    Every word of a catalog name (or alias) but its memory size and 'SXM' must be a word of the CUDA
    name ('RTX-2080Ti' matches 'NVIDIA GeForce RTX 2080 Ti', not 'RTX 4090'); memory picks the variant."""
    import torch

    mem_gib = torch.cuda.get_device_properties(index).total_memory / GiB
    words = [w for w in re.split(r"[^A-Z0-9]+", name.upper()) if w]
    have = set(words) | {a + b for a, b in zip(words, words[1:], strict=False)}

    def matches(key: str) -> bool:
        need = [w for w in key.upper().split("-") if w != "SXM" and not re.fullmatch(r"\d+GB", w)]
        return bool(need) and all(w in have for w in need)

    found = [k for k in CATALOG if matches(k)]
    found += [v for a, v in ALIASES.items() if matches(a) and v not in found]
    if found:
        return min(found, key=lambda k: abs(CATALOG[k]["memory_GiB"] - mem_gib))
    return {"name": name, "based_on": "A100-80GB", "memory_GiB": round(mem_gib, 1)}


def catalog_table() -> str:
    """The device catalog as a text table (what `autopar devices` prints)."""
    rows = [("device", "fp32 TF", "tf32 TF", "fp16 TF", "bf16 TF", "mem GiB", "mem GB/s", "intra-node link",
             "host link", "host GiB/dev")]
    for name in CATALOG:
        s = _spec_from_mapping({"name": name, **CATALOG[name]}, name)
        tf = {k: f"{v / 1e12:g}" for k, v in s.peak_flops.items()}
        rows.append((name, tf["fp32"], tf["tf32"], tf["fp16"], tf.get("bf16", "-"), f"{s.memory / GiB:g}",
                     f"{s.memory_bandwidth / 1e9:g}",
                     f"{s.intra_node.kind} {s.intra_node.bandwidth / 1e9:g} GB/s",
                     f"{s.host_link.kind} {s.host_link.bandwidth / 1e9:g} GB/s",
                     "shared" if s.kind in UNIFIED_KINDS
                     else f"{default_host_memory(name, s.kind, s.memory, 1) / GiB:g}"))
    rows.append(("cpu", "measured", "", "", "", "host RAM", "measured", "-", "-", "shared"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["Cluster", "Device", "DeviceSpec", "Link", "Node", "device_spec", "parse_shorthand",
           "catalog_table", "asdict"]
