"""Measured blocks: per-layer forward / backward / recompute seconds and peak memory timed on the devices
themselves (`autopar profile`, runtime/block_profiler.py) or read from another system's profile table (AMP's
`known_cost` arrays), priced instead of the analytic model where they apply (solver/pricing/model.py).

A `BlockProfile` holds, per (device type, layer index, tensor-parallel degree), points measured at some
micro-batch sizes. `times(..., n)` answers at any size n: the measured point at n, else linear between the two
nearest measured sizes, else (outside them) along the line through the two nearest, or proportional to n from a
single point (as AMP's per-sample figures are meant). Measured seconds are wall time on the device, host
time included: the pricing adds no host terms for a measured layer. `step_s`, where measured, is one
optimizer step over the layer's own parameters (`optimizer` names which), priced instead of the analytic
update. `layers` describe the model measured
(kind and signature per layer); `check(graph)` refuses a profile of another model with a PlanError.

JSON (version 1):

    {"version": 1, "layers": [{"kind": "pre", "signature": "..."}, ...],
     "entries": [{"device_type": "cpu", "layer": 0, "tp": 1, "precision": "fp32",
                  "points": [{"n": 2, "fwd_s": ..., "bwd_s": ..., "recompute_s": ..., "peak_bytes": ...}, ...],
                  "source": "measured by autopar profile on cpu (2026-12-04)",
                  "step_s": ..., "optimizer": "adamw"}, ...],
     "meta": {...}}
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .compute import write_atomic

VERSION = 1


@dataclass(frozen=True)
class Point:
    """One layer measured at micro-batch size n: seconds per micro-batch and the peak bytes it allocated."""

    n: int
    fwd_s: float
    bwd_s: float
    recompute_s: float | None = None  # None: the forward's own time
    peak_bytes: float | None = None


@dataclass(frozen=True)
class Measured:
    """What `BlockProfile.times` answers: seconds per micro-batch of n samples and where they came from."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    peak_bytes: float | None
    source: str


@dataclass
class Entry:
    device_type: str
    layer: int
    tp: int
    precision: str
    points: list[Point]
    source: str = ""
    step_s: float | None = None  # one optimizer step over the layer's own parameters (`optimizer`'s), if measured
    optimizer: str = ""
    step_params: int | None = None  # elements that step updated (a tied parameter steps with its first layer)


@dataclass
class BlockProfile:
    layers: list[dict] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    name: str = "profile"  # what explain() calls it (its file name when loaded)

    def __post_init__(self) -> None:
        self._index = {(e.device_type, e.layer, e.tp, e.precision): e for e in self.entries}

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self._index[(entry.device_type, entry.layer, entry.tp, entry.precision)] = entry

    def device_types(self) -> list[str]:
        return sorted({e.device_type for e in self.entries})

    def coverage(self) -> list[str]:
        """What it measured, as "<device type> tp <degree>" items."""
        return sorted({f"{e.device_type} tp {e.tp}" for e in self.entries})

    def entry(self, device_type: str, layer: int, tp: int, precision: str) -> Entry | None:
        return self._index.get((device_type, layer, tp, precision)) or self._index.get((device_type, layer, tp, "*"))

    def times(self, device_type: str, layer: int, tp: int, precision: str, n: int) -> Measured | None:
        """Seconds of `layer` per micro-batch of n samples on `device_type` at tensor-parallel degree `tp`
        (module docstring), or None where the profile has no such layer."""
        e = self.entry(device_type, layer, tp, precision)
        if e is None or not e.points:
            return None
        pts = sorted(e.points, key=lambda p: p.n)
        exact = next((p for p in pts if p.n == n), None)
        if exact is not None:
            how = f"measured at micro-batch {n}"
            f, b, r, m = exact.fwd_s, exact.bwd_s, _rc(exact), exact.peak_bytes
        elif len(pts) == 1:
            p = pts[0]
            s = n / p.n
            how = f"measured at micro-batch {p.n}, x{s:g} for {n}"
            f, b, r = p.fwd_s * s, p.bwd_s * s, _rc(p) * s
            m = None if p.peak_bytes is None else p.peak_bytes * s
        else:
            lo, hi = _bracket(pts, n)
            w = (n - lo.n) / (hi.n - lo.n)
            line = lambda a, c: max(a + (c - a) * w, 0.0)  # noqa: E731
            inside = lo.n < n < hi.n
            how = (f"{'interpolated' if inside else 'extrapolated'} from micro-batches {lo.n} and {hi.n} to {n}")
            f, b, r = line(lo.fwd_s, hi.fwd_s), line(lo.bwd_s, hi.bwd_s), line(_rc(lo), _rc(hi))
            m = None if lo.peak_bytes is None or hi.peak_bytes is None else line(lo.peak_bytes, hi.peak_bytes)
        return Measured(f, b, r, m, f"{self.name}: {e.source or 'measured'}, {how}")

    def same_for(self, layers: list[int]) -> bool:
        """Whether every device type, degree and precision has the same points for all of `layers` (or none)."""
        groups: dict[tuple, set] = {}
        for e in self.entries:
            if e.layer in layers:
                groups.setdefault((e.device_type, e.tp, e.precision), set()).add(
                    (e.layer, tuple(sorted((p.n, p.fwd_s, p.bwd_s, p.recompute_s) for p in e.points))))
        for found in groups.values():
            if len({pts for _, pts in found}) > 1 or len(found) != len(layers):
                return False
        return True

    def step_seconds(self, device_type: str, layer: int, tp: int, precision: str, optimizer: str) -> float | None:
        """Seconds of one `optimizer` step over `layer`'s parameters, where the profile measured it."""
        e = self.entry(device_type, layer, tp, precision)
        return e.step_s if e is not None and e.step_s is not None and e.optimizer == optimizer else None

    def check(self, graph: Any) -> None:
        """PlanError unless this profile was measured on a model with `graph`'s layers (kinds and signatures)."""
        if not self.layers:
            if any(e.layer >= len(graph.layers) for e in self.entries):
                raise PlanError(f"block profile {self.name!r} names layer "
                                f"{max(e.layer for e in self.entries)}, but the model has {len(graph.layers)} "
                                f"layers: profile this model (`autopar profile`).")
            return
        ours = [(layer.kind, str(layer.signature)) for layer in graph.layers]
        theirs = [(d.get("kind"), str(d.get("signature"))) for d in self.layers]
        if ours != theirs:
            diff = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                        min(len(ours), len(theirs)))
            raise PlanError(f"block profile {self.name!r} was measured on another model: {len(theirs)} layers "
                            f"against this model's {len(ours)}, first differing at layer {diff}. Profile this "
                            f"model (`autopar profile MODULE:FUNCTION --cluster C --out profile.json`).")

    # ---- files ------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "layers": self.layers,
                           "entries": [{**asdict(e), "points": [asdict(p) for p in e.points]} for e in self.entries],
                           "meta": self.meta}, indent=1)

    @staticmethod
    def from_json(text: str, name: str = "profile") -> BlockProfile:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != VERSION or not isinstance(d.get("entries"), list):
            raise PlanError(f"block profile {name!r} is not a version-{VERSION} autopar block profile "
                            f"(`autopar profile` writes one).")
        entries = [Entry(str(e["device_type"]), int(e["layer"]), int(e.get("tp", 1)), str(e.get("precision", "*")),
                         [Point(**p) for p in e["points"]], str(e.get("source", "")),
                         None if e.get("step_s") is None else float(e["step_s"]), str(e.get("optimizer", "")),
                         None if e.get("step_params") is None else int(e["step_params"]))
                   for e in d["entries"]]
        return BlockProfile(list(d.get("layers") or []), entries, dict(d.get("meta") or {}), name)

    def save(self, path: str | os.PathLike) -> Path:
        return write_atomic(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike) -> BlockProfile:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise PlanError(f"cannot read block profile {str(p)!r}: {e}") from e
        if p.suffix.lower() == ".csv":
            raise PlanError(f"{str(p)!r} is a CSV table: read it with BlockProfile.from_amp_csv(path, "
                            f"device_types=..., layers=...), which needs to know which columns and rows are which.")
        try:
            return BlockProfile.from_json(text, p.name)
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"block profile {str(p)!r} is malformed: {e}") from e

    @staticmethod
    def from_amp_csv(path: str | os.PathLike, device_types: dict[str, str], layers: list[list[int]],
                     precision: str = "*") -> BlockProfile:
        """AMP's per-layer profile table (`amp_known_cost_profiles.csv`: one row per layer spec, columns
        `fwd_s_<TYPE>_<mp>`, the forward seconds of one sample at tensor-parallel degree mp). `device_types` maps
        AMP's type names to the cluster's (e.g. {"P3": "V100-16GB", "G4": "T4"}); `layers[i]` lists the spec
        rows that make autopar's layer i (AMP's no-op transposes go with a neighbour). Backward is twice the
        forward, as AMP's own cost model takes it (fwd + bwd = 3 x forward x micro-batch, `get_cost_e`); the
        times scale with the micro-batch (one point at n = 1)."""
        p = Path(path)
        try:
            with p.open(newline="") as fh:
                rows = list(csv.DictReader(fh))
        except OSError as e:
            raise PlanError(f"cannot read AMP profile table {str(p)!r}: {e}") from e
        cols = [c for c in (rows[0].keys() if rows else []) if c.startswith("fwd_s_")]
        if not cols:
            raise PlanError(f"{str(p)!r} has no fwd_s_<TYPE>_<mp> columns: not an AMP known-cost table.")
        prof = BlockProfile(meta={"source": f"AMP known_cost table {p.name}"}, name=p.name)
        for col in cols:
            _, _, amp_type, mp = col.split("_", 3)
            if amp_type not in device_types:
                continue
            for i, specs in enumerate(layers):
                try:
                    fwd = sum(float(rows[s][col]) for s in specs)
                except (IndexError, ValueError) as e:
                    raise PlanError(f"{str(p)!r}: layer {i}'s spec rows {specs} in column {col!r}: {e}") from e
                prof.add(Entry(device_types[amp_type], i, int(mp), precision, [Point(1, fwd, 2 * fwd)],
                               f"AMP known_cost {amp_type} mp {mp} (bwd = 2 x fwd, AMP's rule)"))
        if not prof.entries:
            raise PlanError(f"{str(p)!r}: none of its device types {sorted({c.split('_')[2] for c in cols})} is in "
                            f"device_types={device_types}.")
        return prof


def _rc(p: Point) -> float:
    return p.fwd_s if p.recompute_s is None else p.recompute_s


def _bracket(pts: list[Point], n: int) -> tuple[Point, Point]:
    """The two measured sizes around n (or the two nearest at one end)."""
    if n <= pts[0].n:
        return pts[0], pts[1]
    if n >= pts[-1].n:
        return pts[-2], pts[-1]
    for a, b in zip(pts, pts[1:], strict=False):
        if a.n <= n <= b.n:
            return a, b
    return pts[-2], pts[-1]


def load_block_profile(profile: BlockProfile | str | os.PathLike | None) -> BlockProfile | None:
    """`plan(profile=)`'s argument: a BlockProfile, a path to one (JSON), or None."""
    if profile is None or isinstance(profile, BlockProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return BlockProfile.load(profile)
    raise PlanError(f"profile must be an autopar BlockProfile or the path of one (`autopar profile --out`), got "
                    f"{type(profile).__name__}.")


__all__ = ["BlockProfile", "Entry", "Measured", "Point", "load_block_profile"]
