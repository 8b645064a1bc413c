"""Host-device synchronizations inside a region of code (a training step), found on GPUs and on CPUs.

`host_syncs()` is a context manager that records (or refuses) every operation inside it that makes the host
wait for the device:

    with host_syncs() as found:
        prog.step(*inputs, target=target)
    print(found.sites())  # {"autopar/runtime/program.py:278": 1, ...}

On CUDA it sets `torch.cuda.set_sync_debug_mode` ("warn" to collect, "error" to raise) and records torch's
warnings, each at the Python line that triggered it. On a CPU, where nothing synchronizes, it stands in
for that check: it patches the tensor methods that would force a device-to-host sync on an accelerator
(`item`, `__float__`, `__int__`, `__bool__`, `__index__`, `tolist`, `numpy`, `cpu`, `nonzero`,
`repeat_interleave` with tensor repeats and no `output_size`, `bincount`, `unique`, `masked_select`,
boolean-mask indexing, a blocking `.to` the host: `_to_host`) and records each call made by autopar's
own code (the calling frame is a file inside the autopar package); `deep=True` also records the calls
torch makes on autopar's behalf, each at its innermost autopar frame. Only the thread that entered the
context is watched. On CPU every tensor stands for a device tensor, so reading one that would live on the
host anyway on a GPU run (a CPU-side counter) is recorded too: the sites say which.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import AutoparError

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../autopar
_ROOT = str(Path(_PACKAGE).parent)
_THIS = str(Path(__file__).resolve())


class HostSyncError(AutoparError, RuntimeError):
    """An operation inside `host_syncs(raise_on_sync=True)` made the host wait for the device."""


@dataclass(frozen=True)
class HostSync:
    """One synchronizing call: what it was and where autopar made it ("autopar/runtime/x.py:12", or the
    file and line torch reported on CUDA)."""

    what: str
    site: str


class HostSyncs(list):
    """The `HostSync`s recorded inside one `host_syncs()` region, in order."""

    def sites(self) -> Counter:
        """How many syncs each call site made."""
        return Counter(s.site for s in self)


@functools.lru_cache(maxsize=4096)
def _resolved(filename: str) -> str:
    return str(Path(filename).resolve()) if not filename.startswith("<") else filename


def _site(frame: Any) -> str:  # noqa: ANN401
    path = _resolved(frame.f_code.co_filename)
    rel = path[len(_ROOT) + 1:] if path.startswith(_ROOT + "/") else path
    return f"{rel}:{frame.f_lineno}"


def _in_autopar(frame: Any) -> bool:  # noqa: ANN401
    path = _resolved(frame.f_code.co_filename)
    return path.startswith(_PACKAGE + "/") and path != _THIS


def _caller(deep: bool) -> str | None:
    """The autopar call site of the patched method being run (None: not autopar's call)."""
    frame = sys._getframe(2)  # 0: here, 1: the wrapper, 2: whoever called the tensor method
    while frame is not None and _resolved(frame.f_code.co_filename) == _THIS:
        frame = frame.f_back
    if frame is None:
        return None
    if _in_autopar(frame):
        return _site(frame)
    if not deep:
        return None
    while frame is not None and not _in_autopar(frame):
        frame = frame.f_back
    return _site(frame) if frame is not None else None


def _bool_index(index: Any) -> bool:  # noqa: ANN401
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in parts)


def _to_host(t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """A blocking `.to` the host: from a device tensor, or (the CPU stand-in) to the device named by the
    string "cpu", autopar's way of naming the host explicitly (its device tensors move by `torch.device`)."""
    if kwargs.get("non_blocking") or (len(args) > 2 and isinstance(args[0], (str, torch.device)) and args[2]):
        return False
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if isinstance(target, str) and target == "cpu":
        return True
    if isinstance(target, (str, torch.device)):
        try:
            return t.device.type != "cpu" and torch.device(target).type == "cpu"
        except RuntimeError:
            return False
    return False


# method name -> predicate (self, args, kwargs) -> whether this call synchronizes on an accelerator
_TENSOR_METHODS: dict[str, Callable[[torch.Tensor, tuple, dict], bool]] = {
    "item": lambda t, a, k: True,
    "__float__": lambda t, a, k: True,
    "__int__": lambda t, a, k: True,
    "__bool__": lambda t, a, k: True,
    "__index__": lambda t, a, k: True,
    "tolist": lambda t, a, k: True,
    "numpy": lambda t, a, k: True,
    "cpu": lambda t, a, k: True,
    "nonzero": lambda t, a, k: True,
    "bincount": lambda t, a, k: True,
    "unique": lambda t, a, k: True,
    "masked_select": lambda t, a, k: True,
    "repeat_interleave": lambda t, a, k: isinstance(a[0] if a else k.get("repeats"), torch.Tensor)
    and k.get("output_size") is None,
    "__getitem__": lambda t, a, k: _bool_index(a[0]),
    "to": _to_host,
}
_TORCH_FUNCTIONS: dict[str, Callable[[torch.Tensor, tuple, dict], bool]] = {
    "nonzero": _TENSOR_METHODS["nonzero"],
    "bincount": _TENSOR_METHODS["bincount"],
    "unique": _TENSOR_METHODS["unique"],
    "masked_select": _TENSOR_METHODS["masked_select"],
    "repeat_interleave": lambda t, a, k: isinstance(a[0] if a else k.get("repeats"), torch.Tensor)
    and k.get("output_size") is None,
}


class _Patches:
    def __init__(self, found: HostSyncs, raise_on_sync: bool, deep: bool) -> None:
        self.found, self.raise_on_sync, self.deep = found, raise_on_sync, deep
        self.thread = threading.get_ident()
        self.busy = False  # a patched call inside a patched call (torch's own use) is not recorded twice
        self.undo: list[Callable[[], None]] = []

    def wrap(self, name: str, original: Callable, syncs: Callable[[Any, tuple, dict], bool]) -> Callable:
        def patched(t: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            if not self.busy and threading.get_ident() == self.thread and syncs(t, args, kwargs):
                site = _caller(self.deep)
                if site is not None:
                    if self.raise_on_sync:
                        raise HostSyncError(f"{name} at {site} makes the host wait for the device.")
                    self.found.append(HostSync(name, site))
            busy, self.busy = self.busy, True
            try:
                return original(t, *args, **kwargs)
            finally:
                self.busy = busy

        return patched

    def install(self) -> None:
        for name, syncs in _TENSOR_METHODS.items():
            self._set(torch.Tensor, name, self.wrap(f"Tensor.{name}", getattr(torch.Tensor, name), syncs))
        for name, syncs in _TORCH_FUNCTIONS.items():
            self._set(torch, name, self.wrap(f"torch.{name}", getattr(torch, name), syncs))

    def _set(self, owner: Any, name: str, value: Callable) -> None:  # noqa: ANN401
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)
        self.undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def remove(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


@contextlib.contextmanager
def host_syncs(raise_on_sync: bool = False, device: torch.device | str | None = None,
               deep: bool = False) -> Iterator[HostSyncs]:
    """Record the host-device syncs inside the block, or with `raise_on_sync` refuse the first one (on CPU a
    `HostSyncError` naming autopar's call site; on CUDA torch's sync debug mode raises its RuntimeError).

    `device`: where the audited code keeps its tensors; "cuda" uses torch's sync debug mode, anything else
    (default: "cuda" when CUDA is available, else "cpu") the CPU stand-in described in the module doc.
    `deep`: on CPU, also record the syncing calls torch makes inside autopar's calls (at autopar's frame)."""
    found = HostSyncs()
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("error" if raise_on_sync else "warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                for w in caught:
                    if "synchroniz" in str(w.message):
                        found.append(HostSync(str(w.message).splitlines()[0], f"{w.filename}:{w.lineno}"))
                    else:
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return
    patches = _Patches(found, raise_on_sync, deep)
    patches.install()
    try:
        yield found
    finally:
        patches.remove()


__all__ = ["HostSync", "HostSyncError", "HostSyncs", "host_syncs"]
