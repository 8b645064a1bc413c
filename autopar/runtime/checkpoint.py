"""Sharded checkpoints through torch.distributed.checkpoint (DCP), loadable under any plan or world size.

Layout (DCP's own FileSystemWriter format: one .distcp file per rank plus .metadata). Keys follow the
flattened form of torch's `{"model": ..., "optim": ...}` state dicts:

* ``model.<fqn>``: a parameter or persistent buffer of the original model, under its fully qualified
  name (a tied weight once, under the name the capture resolves ties to);
* ``optim.state.<fqn>.<key>``: the optimizer state of that parameter (``exp_avg``, ``step``, ...);
* ``step``: the program's step counter (int64 scalar), ``autopar.plan``: the plan's JSON (informational).

Who writes what. Every entry is written by exactly one rank, so no rank gathers anything: a parameter by
its ZeRO owner group (the first holding group without ZeRO, `ZeroRuntime.is_source`), a buffer by the
lowest rank holding it, entries no stage holds (parameters of unused modules) by rank 0 from the
original model. Inside a tensor-parallel group, sharded parameters and their optimizer state go to DCP as
DTensors, so each rank of the group writes its own shard and nothing is gathered; replicated ones (and
scalars like Adam's ``step``) are written as plain tensors by the group's first rank.

Loading reshards: each rank asks DCP for the full-shaped tensors it needs under the *current* layout
(the parameters it keeps, the optimizer state it owns, its buffers) and DCP reads the overlapping
pieces of whatever shards the saving ranks wrote. So a checkpoint saved under one plan loads under
another plan, another world size, or (`load_into_model`) into the plain single-device model.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..errors import AutoparError
from .zero import local_tensor

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .program import Program

MODEL, OPTIM, STEP, PLAN = "model.", "optim.state.", "step", "autopar.plan"


class CheckpointError(AutoparError, ValueError):
    """A checkpoint is missing, incomplete or does not match the model it is loaded into."""


# ---- save ------------------------------------------------------------------------------------------


def save(prog: Program, path: str | os.PathLike) -> None:
    """Write `prog`'s sharded state to directory `path` (collective: every rank calls it)."""
    sd = _local_state(prog)
    with quiet_dcp() as dcp:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=not _distributed(prog))


def _distributed(prog: Program) -> bool:
    return prog.world_size > 1 and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def quiet_dcp() -> Iterator[Any]:
    """torch.distributed.checkpoint, with its warning that it assumes a single process silenced, around the
    saves and loads (here, whole_model and weights.DCPSource) where a single process is intended. Imported on
    first use: ~0.3 s of CPU at every process's start (`autopar run`'s workers, the CLI) that never saves."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                                  "uninitialized")
        yield dcp


def _local_state(prog: Program) -> dict[str, Any]:
    """The entries this rank writes (see the module docstring for who writes what)."""
    zero, canon = prog.zero, prog._canonical
    sd: dict[str, Any] = {}
    for name in sorted(prog.params):
        if not zero.is_source(name):
            continue
        st = zero.state[name]
        p = prog.params[name]
        local = st.host if st.released else local_tensor(p)
        assert local is not None  # the source keeps the value (ZeRO-3 non-owners are never sources)
        if local.dtype != p.dtype:
            local = local.to(p.dtype)
        _put(prog, sd, MODEL + name, name, local.detach())
        if prog.optimizer is not None and st.owned:
            for key, v in prog.optimizer.state.get(zero.opt_param(name), {}).items():
                if v is None:
                    continue
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    _put(prog, sd, f"{OPTIM}{name}.{key}", name, local_tensor(v).detach())
                elif _first_of_group(prog):
                    sd[f"{OPTIM}{name}.{key}"] = local_tensor(v).detach().clone() if isinstance(v, torch.Tensor) \
                        else v
    persistent = _persistent_state(prog)
    held = _buffer_writers(prog)
    for fqn, b in sorted(prog.buffers.items()):
        key = canon.get(fqn, fqn)
        if key in persistent and held.get(key) == prog.rank:
            sd[MODEL + key] = b.detach()
    if prog.rank == 0:
        written_anywhere = set(prog.holders) | set(held)
        for key, t in persistent.items():
            if key not in written_anywhere:  # no stage holds it, so training never changed it
                sd[MODEL + key] = t.detach()
        sd[STEP] = torch.tensor(prog.step_count, dtype=torch.int64)
        if prog.plan is not None and hasattr(prog.plan, "to_json"):
            sd[PLAN] = prog.plan.to_json(indent=None)
    return sd


def _put(prog: Program, sd: dict[str, Any], key: str, name: str, local: torch.Tensor) -> None:
    """A tensor-parallel shard as a DTensor (each rank writes its part); anything else, once per group."""
    p = prog.params[name]
    if isinstance(p, DTensor) and not all(isinstance(pl, Replicate) for pl in p.placements):
        mesh = p.device_mesh
        if mesh.device_type != local.device.type:
            # a CPU copy (offload): describe it on a CPU mesh of the same group rather than copy it back
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(mesh.get_group(), local.device.type)
        sd[key] = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
    elif _first_of_group(prog):
        sd[key] = local


def _first_of_group(prog: Program) -> bool:
    return prog.zero.my_group[0] == prog.rank


def _persistent_state(prog: Program) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor of every entry of the original model's state_dict (ties once)."""
    canon = prog._canonical
    out: dict[str, torch.Tensor] = {}
    for fqn, t in prog._model.state_dict(keep_vars=False).items():
        out.setdefault(canon.get(fqn, fqn), t)
    return out


def _buffer_writers(prog: Program) -> dict[str, int]:
    """Canonical buffer name -> the lowest rank whose stages hold it (computed alike on every rank)."""
    graph, canon = prog.graph, prog._canonical
    by_layer: dict[int, set[str]] = {}
    for n in graph.nodes.values():
        for a in n.args:
            info = graph.params.get(a)
            if info is not None and info.is_buffer:
                by_layer.setdefault(n.layer, set()).add(canon.get(info.name, info.name))
    writer: dict[str, int] = {}
    for pipe in prog.layout.pipelines:
        for st in pipe.stages:
            for layer in range(*st.layers):
                for name in by_layer.get(layer, ()):
                    writer[name] = min(writer.get(name, st.ranks[0]), st.ranks[0])
    return writer


# ---- load into a program ----------------------------------------------------------------------------


def load(prog: Program, path: str | os.PathLike) -> None:
    """Load a checkpoint saved under any plan into `prog` (collective: every rank calls it)."""
    md = read_metadata(path)
    entries = md.state_dict_metadata
    zero, canon = prog.zero, prog._canonical
    persistent = _persistent_state(prog)
    # every rank checks the whole model, so a mismatch stops all of them rather than leaving the ranks that
    # do not hold the offending tensor waiting in the collective load
    for key, t in persistent.items():
        _check(entries, MODEL + key, tuple(t.shape), path)
    _check_no_extra(entries, {MODEL + k for k in persistent}, path)
    if STEP not in entries:
        raise CheckpointError(f"checkpoint {str(path)!r} has no step counter: it was not written by "
                              f"Program.save().")
    request: dict[str, Any] = {}
    opt_keys: dict[str, list[str]] = {}
    for name in sorted(prog.params):
        st = zero.state[name]
        if st.keeps_value:
            where = st.host if st.released and st.host is not None else local_tensor(prog.params[name])
            request[MODEL + name] = _empty(entries, MODEL + name, tuple(prog.params[name].shape), path,
                                           where.device)
        if prog.optimizer is not None and st.owned:
            prefix = f"{OPTIM}{name}."
            opt_keys[name] = [k for k in entries if k.startswith(prefix) and "." not in k[len(prefix):]]
            device = local_tensor(zero.opt_param(name)).device
            for k in opt_keys[name]:
                request[k] = _empty(entries, k, None, path, device)
    for fqn, b in prog.buffers.items():
        key = canon.get(fqn, fqn)
        if key in persistent:
            request[MODEL + key] = _empty(entries, MODEL + key, tuple(b.shape), path, b.device)
    request[STEP] = torch.zeros((), dtype=torch.int64)
    with quiet_dcp() as dcp:
        dcp.load(request, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not _distributed(prog))
    for name in sorted(prog.params):
        if MODEL + name in request:
            zero.load_param(name, request[MODEL + name])
        if name in opt_keys:
            state = {k[len(f"{OPTIM}{name}."):]: request[k] for k in opt_keys[name]}
            zero.load_opt_state(name, prog.optimizer, state)
    with torch.no_grad():
        for fqn, b in prog.buffers.items():
            key = MODEL + canon.get(fqn, fqn)
            if key in request:
                b.copy_(request[key])
    prog.step_count = int(request[STEP])


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The checkpoint's DCP metadata; a clear error when `path` is not a complete checkpoint."""
    p = Path(path)
    if not (p / ".metadata").is_file():
        what = "does not exist" if not p.exists() else \
            "has no .metadata (not a DCP checkpoint, or its save did not finish)"
        raise CheckpointError(f"checkpoint {str(path)!r} {what}; pass a directory written by "
                              f"Program.save() (elastic training keeps them under <dir>/step_<n>).")
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(p)).read_metadata()


def _empty(entries: dict, key: str, shape: tuple[int, ...] | None, path: str | os.PathLike,
           device: torch.device | str = "cpu") -> Any:
    """A full-shaped destination for `key` (scalars stay on the CPU, like Adam's step), checked against what
    the checkpoint holds."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = _check(entries, key, shape, path)
    if isinstance(md, BytesStorageMetadata):
        return None
    size = tuple(md.size)
    return torch.empty(size, dtype=md.properties.dtype, device=device if size else "cpu")


def _check_no_extra(entries: dict, expected: set[str], path: str | os.PathLike) -> None:
    extra = sorted(k for k in entries if k.startswith(MODEL) and k not in expected)
    if extra:
        raise CheckpointError(f"checkpoint {str(path)!r} holds {len(extra)} model entries this model does "
                              f"not have (e.g. {extra[:3]}): it was saved from a different model; load it "
                              f"into the model it was saved from.")


def _check(entries: dict, key: str, shape: tuple[int, ...] | None, path: str | os.PathLike) -> Any:
    """The metadata of `key`; an error naming the problem when it is missing or has another shape."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = entries.get(key)
    if md is None:
        near = sorted(k for k in entries if k.startswith(MODEL))[:5]
        raise CheckpointError(f"checkpoint {str(path)!r} has no entry {key!r} (it holds e.g. {near}): it was "
                              f"saved from a different model; load it into the model it was saved from.")
    if isinstance(md, BytesStorageMetadata):
        return md
    assert isinstance(md, TensorStorageMetadata)
    if shape is not None and tuple(md.size) != shape:
        raise CheckpointError(f"checkpoint {str(path)!r} holds {key!r} with shape {list(md.size)}, but the "
                              f"model's tensor has shape {list(shape)}: it was saved from a differently "
                              f"sized model.")
    return md


# ---- load into the plain model -------------------------------------------------------------------------


def load_into_model(model: nn.Module, path: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None, only: set[str] | None = None) -> int:
    """Load a checkpoint written by `Program.save` (under any plan) into the original single-device model
    and, when given, an optimizer over its parameters; returns the saved step count. `only`: load just these
    model entries (and their optimizer state), the rest of the checkpoint left unread (a layer pipeline's rank
    holding one stage).

    Reads with DCP in no-dist mode, so it works in a plain process and inside a distributed job alike."""
    md = read_metadata(path)
    entries = md.state_dict_metadata
    named = model.state_dict(keep_vars=True)
    if only is not None:
        named = {k: v for k, v in named.items() if k in only}
    # a tied weight appears under several names in the model but once in the checkpoint
    key_of: dict[str, str] = {}
    by_tensor: dict[int, str] = {}
    for fqn, t in named.items():
        if MODEL + fqn in entries:
            by_tensor.setdefault(id(t), fqn)
    for fqn, t in named.items():
        src = fqn if MODEL + fqn in entries else by_tensor.get(id(t))
        if src is None:
            _check(entries, MODEL + fqn, None, path)  # raises the missing-entry error
        key_of[fqn] = src  # type: ignore[assignment]
    if only is None:
        _check_no_extra(entries, {MODEL + src for src in key_of.values()}, path)
    request: dict[str, Any] = {}
    for fqn, src in key_of.items():
        request.setdefault(MODEL + src, _empty(entries, MODEL + src, tuple(named[fqn].shape), path))
    opt_keys: dict[str, list[str]] = {}
    if optimizer is not None:
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for fqn, p in model.named_parameters():
            if only is not None and fqn not in only:
                continue
            if id(p) not in in_opt:
                if not p.requires_grad:  # a frozen parameter: no optimizer state to load
                    continue
                raise CheckpointError(f"the optimizer passed to load_into_model does not hold parameter "
                                      f"{fqn!r}; build it over model.parameters().")
            prefix = f"{OPTIM}{key_of[fqn]}."
            opt_keys[fqn] = [k for k in entries if k.startswith(prefix) and "." not in k[len(prefix):]]
            for k in opt_keys[fqn]:
                request[k] = _empty(entries, k, None, path)
    request[STEP] = torch.zeros((), dtype=torch.int64)
    with quiet_dcp() as dcp:
        dcp.load(request, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    with torch.no_grad():
        for fqn, src in key_of.items():
            named[fqn].copy_(request[MODEL + src])
    if optimizer is not None:
        for fqn, p in model.named_parameters():
            if fqn not in opt_keys:
                continue
            prefix = f"{OPTIM}{key_of[fqn]}."
            state = {k[len(prefix):]: request[k] for k in opt_keys[fqn]}
            if state:
                optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in state.items()}
    return int(request[STEP]) if STEP in entries else 0


# ---- checkpoint directories ----------------------------------------------------------------------------


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest(root: str | os.PathLike) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint under `root` (DCP writes .metadata last)."""
    best: tuple[int, Path] | None = None
    d = Path(root)
    if not d.is_dir():
        return None
    for p in d.glob("step_*"):
        try:
            step = int(p.name[len("step_"):])
        except ValueError:
            continue
        if (p / ".metadata").is_file() and (best is None or step > best[0]):
            best = (step, p)
    return best


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root`."""
    import shutil

    done = sorted((int(p.name[len("step_"):]), p) for p in Path(root).glob("step_*")
                  if p.name[len("step_"):].isdigit() and (p / ".metadata").is_file())
    for _, p in done[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


__all__ = ["CheckpointError", "save", "load", "load_into_model", "read_metadata", "latest", "prune",
           "step_dir"]
