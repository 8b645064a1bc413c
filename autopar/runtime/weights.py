"""Weights for models bigger than one process: `autopar.compile(meta_model, ..., weights=...)`.

A model built under `torch.device("meta")` has shapes but no values. Each rank then allocates only what the
plan gives it (its stages' parameters, its tensor-parallel shards) and reads only those from `weights`:

* a ``.safetensors`` file; a Hugging Face directory of safetensors shards (``model.safetensors.index.json``,
  a single ``model.safetensors``, or ``*.safetensors`` files); read with `safe_open(...).get_slice`, so a
  ``Shard(d)`` tensor-parallel parameter reads only this rank's slice;
* a checkpoint directory written by `Program.save` (torch DCP), read with `dcp.load` (no collective) into
  full tensors or, for ``Shard(d)`` parameters, DTensors: DCP reads only the overlapping pieces.

Names are the model's `state_dict()` names. A tied weight may be stored under any of its names (or all).
Tensors are cast to the model's dtype. Names or shapes that do not match the model raise a PlanError naming
the first missing, unexpected and wrongly shaped entries, on every rank before any collective.

Non-persistent buffers (rotary ``inv_freq``) are not in weight files: they come from the file when it has
them, else from the model when it is not on meta, else from the owning module's own initialization run on
a CPU copy of that module alone (Hugging Face `_init_weights`, else `reset_parameters()`).

A meta model without `weights` gets a deterministic initialization: every module's own tensors are made by
its own init (as above) under a seed derived from `seed` and the module's name, so the values do not depend
on the plan, the rank or the other modules; `materialize(model, seed=0)` gives a single process exactly the
same values. A tensor whose module has no init that sets it raises a PlanError (pass `weights=` then).
A non-meta model with `weights` trains from those weights.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import PlanError
from ..passes.capture import is_on_meta, to_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..codegen.split import StageProgram

WeightsArg = str | os.PathLike | None
_FORMATS = ("a .safetensors file, a Hugging Face directory of safetensors shards (with "
            "model.safetensors.index.json or model.safetensors), or a checkpoint directory written by "
            "Program.save()")


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


# ---- sources: where stored tensors are read from ------------------------------------------------------


class WeightSource:
    """Named tensors on disk: their shapes, and reads of one tensor or a slice of it (CPU tensors)."""

    where: str = ""
    read_bytes: int = 0  # bytes read so far (what the memory tests check)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def read_dtensor(self, key: str, mesh: DeviceMesh, placement: Placement) -> DTensor:
        """This rank's shard of `key` under `placement` on `mesh`, reading only that slice."""
        shape = self.shapes()[key]
        local, offset = compute_local_shape_and_global_offset(shape, mesh, [placement])
        index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        return DTensor.from_local(self.read(key, index), mesh, [placement], run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.read_bytes += t.numel() * t.element_size()
        return t


# safetensors' dtype names (its format spec) -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


class SafetensorsSource(WeightSource):
    """One or several .safetensors files (a Hugging Face sharded directory).

    Reads go to the file, only for the bytes of the requested slice, into a tensor of the slice's size:
    safetensors' own torch reader (`safe_open(framework="pt")`) backs every tensor by one storage over the
    whole file, which the allocator counts as the whole model on every rank for as long as the handle is
    open. safe_open lists the names; the tensors' offsets come from the file's header (the format's spec:
    8-byte little-endian header size, JSON header, data)."""

    def __init__(self, files: list[Path], where: str, index: dict[str, Path] | None = None) -> None:
        self.where = where
        self._file_of: dict[str, Path] = {}
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}  # dtype, shape, file offset
        for path in sorted(set(files)):
            for key, entry in self._header(path).items():
                if key in self._file_of:
                    raise PlanError(f"weights {where!r}: tensor {key!r} is stored in both "
                                    f"{self._file_of[key].name} and {path.name}.")
                self._file_of[key] = path
                self._entries[key] = entry
        for key, path in (index or {}).items():
            if self._file_of.get(key) != path:
                raise PlanError(f"weights {where!r}: the index maps {key!r} to {path.name}, which does not "
                                f"hold it; the shard files do not match model.safetensors.index.json.")
        self._shapes = {k: e[1] for k, e in self._entries.items()}

    def _header(self, path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:  # validates the file; no tensor is read
            keys = list(f.keys())
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out = {}
        for key in keys:
            e = header[key]
            if e["dtype"] not in _ST_DTYPES:
                raise PlanError(f"weights {self.where!r}: tensor {key!r} has dtype {e['dtype']}, which autopar "
                                f"cannot read; store it as one of {sorted(_ST_DTYPES)}.")
            out[key] = (_ST_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + e["data_offsets"][0])
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._shapes

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        dtype, shape, start = self._entries[key]
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape, strict=False))
        index += tuple(slice(0, n) for n in shape[len(index):])
        out = torch.empty(tuple(s.stop - s.start for s in index), dtype=dtype)
        if out.numel() == 0:
            return out
        # the slice is runs of contiguous bytes: the innermost dimension cut short and everything inside it
        inner = max((d for d, (s, n) in enumerate(zip(index, shape, strict=True)) if s.stop - s.start != n),
                    default=0)
        size = torch.tensor([], dtype=dtype).element_size()
        stride = _contiguous_stride(shape)
        run = out.numel() // max(1, math.prod(s.stop - s.start for s in index[:inner]))
        buf = out.view(-1).view(torch.uint8)
        with open(self._file_of[key], "rb", buffering=0) as fh:
            for i, outer in enumerate(itertools.product(*(range(s.start, s.stop) for s in index[:inner]))):
                first = sum(o * st for o, st in zip((*outer, index[inner].start), stride, strict=False)) \
                    if shape else 0
                fh.seek(start + first * size)
                view = memoryview(buf[i * run * size:(i + 1) * run * size].numpy())
                got = fh.readinto(view)
                if got != len(view):
                    raise PlanError(f"weights {self.where!r}: {self._file_of[key].name} ends inside tensor "
                                    f"{key!r}: the file is truncated.")
        return self._count(out)


class DCPSource(WeightSource):
    """A checkpoint directory written by `Program.save` (its ``model.<fqn>`` entries)."""

    PREFIX = "model."

    def __init__(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .checkpoint import read_metadata

        self.where, self._dcp = str(path), dcp
        md = read_metadata(path)
        self._props = {k[len(self.PREFIX):]: v for k, v in md.state_dict_metadata.items()
                       if k.startswith(self.PREFIX) and isinstance(v, TensorStorageMetadata)}

        class MetadataReadOnce(dcp.FileSystemReader):
            """Every tensor is its own `dcp.load`: without this each of them would read and unpickle the
            whole checkpoint's metadata again (quadratic in the number of tensors)."""

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return md

        self._reader = MetadataReadOnce(self.where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.size) for k, v in self._props.items()}

    def _load(self, key: str, dest: torch.Tensor) -> None:
        from .checkpoint import quiet_dcp

        with quiet_dcp():
            self._dcp.load({self.PREFIX + key: dest}, storage_reader=self._reader, no_dist=True)

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        md = self._props[key]
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        self._load(key, full)
        return self._count(full if index is None else full[index].contiguous())

    def read_dtensor(self, key: str, mesh: DeviceMesh, placement: Placement) -> DTensor:
        # a DTensor destination makes DCP read only the pieces overlapping this rank's shard
        md = self._props[key]
        shape = tuple(md.size)
        local, _ = compute_local_shape_and_global_offset(shape, mesh, [placement])
        dest = DTensor.from_local(torch.empty(local, dtype=md.properties.dtype), mesh, [placement],
                                  run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))
        self._load(key, dest)
        self._count(dest.to_local())
        return dest


def open_source(weights: str | os.PathLike) -> WeightSource:
    """The WeightSource of a `weights=` argument (see the module docstring for the formats)."""
    p = Path(weights)
    if p.is_file() and p.suffix == ".safetensors":
        return SafetensorsSource([p], str(p))
    if p.is_dir():
        if (p / ".metadata").is_file():
            return DCPSource(p)
        index = p / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise PlanError(f"weights {str(p)!r}: {index.name} has no readable weight_map ({e}).") from None
            files = {k: p / v for k, v in weight_map.items()}
            absent = sorted({f.name for f in files.values() if not f.is_file()})
            if absent:
                raise PlanError(f"weights {str(p)!r}: {index.name} names shard files that are not there: "
                                f"{absent[:3]}.")
            return SafetensorsSource(list(files.values()), str(p), files)
        shards = sorted(p.glob("*.safetensors"))
        if shards:
            return SafetensorsSource(shards, str(p))
    what = "does not exist" if not p.exists() else "is not one of the formats autopar reads"
    raise PlanError(f"weights {str(weights)!r} {what}: pass {_FORMATS}.")


# ---- what a program materializes its tensors from ----------------------------------------------------


is_meta = is_on_meta


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for k, b in mod._buffers.items():
            if b is not None and k in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{k}" if mod_name else k] = b
    return out


def _ignored(model: nn.Module) -> list[re.Pattern]:
    """Hugging Face's patterns of checkpoint keys a model ignores (e.g. old rotary inv_freq entries)."""
    return [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]


class ModelWeights:
    """The values a Program (or `materialize`) gives a model's tensors: from `weights`, from the model itself
    when it is not on meta, or from the deterministic init. `created_bytes` counts what was made."""

    def __init__(self, model: nn.Module, weights: WeightsArg = None, seed: int = 0,
                 device: torch.device | None = None) -> None:
        self.model, self.seed = model, seed
        self.meta = is_meta(model)
        self.device = device or _program_device(model)
        self.source = open_source(weights) if weights is not None else None
        self.created_bytes = 0
        sd = model.state_dict(keep_vars=True)
        self._tensors: dict[str, torch.Tensor] = {**dict(model.named_parameters(remove_duplicate=False)),
                                                  **dict(model.named_buffers(remove_duplicate=False)), **sd}
        groups: dict[int, list[str]] = {}
        for fqn, t in self._tensors.items():
            groups.setdefault(id(t), []).append(fqn)
        self._first = {fqn: names[0] for names in groups.values() for fqn in names}  # tie group -> owner
        self._key: dict[str, str] = {}  # model name -> the source's key holding its value
        if self.source is not None:
            self._match(groups, set(sd))
        self._init_cache: tuple[str, dict[str, torch.Tensor]] | None = None

    def _match(self, groups: dict[int, list[str]], persistent: set[str]) -> None:
        assert self.source is not None
        stored = self.source.shapes()
        missing, wrong = [], []
        for names in groups.values():
            present = [n for n in names if n in stored]
            shape = tuple(self._tensors[names[0]].shape)
            wrong += [(n, stored[n], shape) for n in present if stored[n] != shape]
            if present:
                self._key.update((n, present[0]) for n in names)
            elif any(n in persistent for n in names):
                missing.append(names[0])
        ignored = _ignored(self.model)
        unexpected = sorted(k for k in stored if k not in self._key and not any(p.search(k) for p in ignored))
        if not (missing or unexpected or wrong):
            return
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        if wrong:
            parts.append(f"{len(wrong)} with another shape (e.g. " + ", ".join(
                f"{n!r}: stored {list(s)} vs model {list(m)}" for n, s, m in wrong[:3]) + ")")
        raise PlanError(f"weights {self.source.where!r} do not match the model: {'; '.join(parts)}. Pass the "
                        f"weights saved from this model (same architecture and config; state_dict() names).")

    # ---- per tensor ----------------------------------------------------------------------------------
    def full(self, name: str) -> torch.Tensor:
        """The whole value of model tensor `name` (any of a tie's names), on the program's device."""
        like = self._tensors[name]
        if name in self._key:
            assert self.source is not None
            value = self.source.read(self._key[name])
        elif like.device.type != "meta":  # copied straight to the program's device: no second copy on cuda:0
            return like.detach().to(device=self.device, dtype=like.dtype, copy=True)
        else:
            value = self._initialized(self._first[name])
        return value.to(device=self.device, dtype=like.dtype)

    def param(self, name: str, tp: Any = None, experts: Any = None) -> torch.Tensor | None:
        """This rank's value of parameter `name`: a tensor-parallel shard as a DTensor (a `Shard(d)` one read
        as just that slice from `weights`), a local expert's slice; None for another rank's expert."""
        placement = tp.placement(name) if tp is not None else None
        if isinstance(placement, Shard) and experts is None and name in self._key:
            assert self.source is not None
            read = self.source.read_dtensor(self._key[name], tp.mesh, placement)
            local = read.to_local().to(device=self.device, dtype=self._tensors[name].dtype)
            value = DTensor.from_local(local, tp.mesh, [placement], run_check=False, shape=read.shape,
                                       stride=read.stride())
        else:
            value = self.full(name)
            if experts is not None and (value := experts.local_value(name, value)) is None:
                return None
            if tp is not None:
                value = tp.shard(name, value)
        local = value.to_local() if isinstance(value, DTensor) else value
        self.created_bytes += local.numel() * local.element_size()
        return value

    def constant(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor the capture made from Python data (a lifted constant), on the program's device."""
        if value.is_meta:
            raise PlanError(f"a {list(value.shape)} {value.dtype} constant of the meta model's forward has no "
                            f"value (the capture could not make it on the CPU): build the model outside the "
                            f"meta device, or make that tensor a registered buffer.")
        out = value.to(self.device, copy=True)
        self.created_bytes += out.numel() * out.element_size()
        return out

    def buffer(self, name: str) -> torch.Tensor:
        value = self.full(name)
        self.created_bytes += value.numel() * value.element_size()
        return value

    def _initialized(self, name: str) -> torch.Tensor:
        """`name`'s value under the deterministic init: its module's own init on a CPU copy of that module's
        own tensors (its children stay meta), seeded by `seed` and the module's name."""
        owner, _, attr = name.rpartition(".")
        if self._init_cache is None or self._init_cache[0] != owner:
            self._init_cache = (owner, _init_module(self.model, owner, self.seed))
        value = self._init_cache[1].get(attr)
        if value is None:
            what = "a non-persistent buffer" if name in _non_persistent(self.model) else "a tensor"
            raise PlanError(
                f"cannot make {what} {name!r} of the meta model: its module "
                f"({type(self.model.get_submodule(owner)).__name__}) has no init that sets it (Hugging Face "
                f"_init_weights or reset_parameters()). Pass weights= (a file holding it), or build that "
                f"module outside the meta device.")
        return value

    # ---- capture on meta -----------------------------------------------------------------------------
    def capture_args(self, inputs: tuple, target: Any) -> tuple[tuple, Any]:
        """Example inputs as meta tensors when the model is on meta (a capture needs one device)."""
        if not self.meta:
            return inputs, target
        return to_meta((tuple(inputs), target))

    def retarget(self, st: StageProgram) -> StageProgram:
        """A stage program with the devices its capture names (arange, full, to, asserts: the meta device, the
        CPU or cuda:0, wherever the model was captured) set to the program's device."""
        device = self.device
        swap = lambda a: device if isinstance(a, torch.device) and a != device else a
        for gm in (st.gm, st.eval_gm):
            if gm is None:
                continue
            for node in gm.graph.nodes:
                node.args = torch.utils._pytree.tree_map(swap, node.args)
                node.kwargs = torch.utils._pytree.tree_map(swap, node.kwargs)
                if node.op == "get_attr":  # a tensor constant of the capture (a lifted scalar tensor)
                    value = getattr(gm, node.target, None) if "." not in str(node.target) else None
                    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                            and value.device != device:
                        setattr(gm, node.target, value.to(device))
            gm.recompile()
        return st


def _program_device(model: nn.Module) -> torch.device:
    """Where a program keeps its tensors: the model's device, or for a meta model this rank's GPU under NCCL,
    else the CPU."""
    d = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    if d is not None:
        return d
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _init_module(model: nn.Module, owner: str, seed: int) -> dict[str, torch.Tensor]:
    """Module `owner`'s own parameters and buffers made by its own init (see `ModelWeights._initialized`);
    tensors its init did not set are left out."""
    mod = model.get_submodule(owner)
    init = None
    for prefix in [""] + [".".join(owner.split(".")[:i]) for i in range(1, owner.count(".") + 2) if owner]:
        up = model.get_submodule(prefix)
        if callable(getattr(up, "_init_weights", None)) and hasattr(up, "config"):
            init = up._init_weights  # the deepest Hugging Face PreTrainedModel above the module
    clone = copy.copy(mod)  # its own attribute dict: the tensors below replace only the copy's
    fresh = lambda t: torch.full(t.shape, float("nan"), dtype=t.dtype) if t.is_floating_point() \
        else torch.zeros(t.shape, dtype=t.dtype)
    clone._parameters = {k: None if p is None else nn.Parameter(fresh(p), p.requires_grad)
                         for k, p in mod._parameters.items()}
    clone._buffers = {k: None if b is None else fresh(b) for k, b in mod._buffers.items()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(zlib.crc32(f"{seed}/{owner}".encode()))
        if init is not None:
            init(clone)
        elif callable(getattr(clone, "reset_parameters", None)):
            clone.reset_parameters()
    out = {}
    for k, t in [*clone._parameters.items(), *clone._buffers.items()]:
        if t is not None and not (t.is_floating_point() and bool(torch.isnan(t).any())):
            out[k] = t.detach()
    return out


def materialize(model: nn.Module, seed: int = 0, weights: WeightsArg = None) -> nn.Module:
    """Fill a meta model on the CPU, in place, with exactly the values `autopar.compile(model, ..., weights=)`
    gives the ranks: from `weights` when given, else the deterministic per-module init under `seed` (see
    autopar/runtime/weights.py). Tied weights stay tied. Also loads `weights` into a non-meta model.
    Returns `model`."""
    mw = ModelWeights(model, weights, seed, next((p.device for p in model.parameters() if not p.is_meta),
                                                 torch.device("cpu")))
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            for k, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(mw.full(prefix + k), p.requires_grad)
                    mod._parameters[k] = made[id(p)]
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    if id(b) not in made:
                        made[id(b)] = mw.full(prefix + k)
                    mod._buffers[k] = made[id(b)]
    return model


__all__ = ["DCPSource", "ModelWeights", "SafetensorsSource", "WeightSource", "WeightsArg", "is_meta",
           "materialize", "open_source"]
