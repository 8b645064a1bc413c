"""`runtime/dist.wait` on gloo with a re-route watch: the store it polls for an announced loss is hosted by one
rank, which leaves when its own job is done (its process group destroyed with the store's server). A peer still
finishing a collective then finds the store gone: that must not fail the collective (it failed
tests/test_accumulation_memory.py's pp2-dp2 case once on a loaded host: rank 3's bucketed all-reduce, "Failed to
recv, got 0 bytes" from the store); the work is waited for as without a watch."""

from __future__ import annotations

import pytest
from torch.distributed import DistNetworkError

from autopar.runtime import dist as dist_mod

pytestmark = pytest.mark.timeout(60)


class _GoneStore:
    """A store whose host has left: every request fails as torch's TCPStore client does then."""

    def __init__(self) -> None:
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def get(self, key: str) -> bytes:
        raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")


class _Work:
    """A pollable collective that completes once the store has been asked (so the watch is exercised)."""

    def __init__(self, store: _GoneStore) -> None:
        self.store = store
        self.waited = False

    def get_future(self) -> object:
        return object()

    def is_completed(self) -> bool:
        return self.store.checks > 0

    def wait(self, timeout: object = None) -> bool:
        self.waited = True
        return True


def test_a_store_whose_host_left_does_not_fail_a_collective(monkeypatch) -> None:
    store = _GoneStore()
    work = _Work(store)
    monkeypatch.setattr(dist_mod, "_abort_watch", (store, "reroute"))
    dist_mod.wait(work, "bucketed gradient all-reduce", "in its group", 10.0, None, "cpu")
    assert store.checks == 1 and work.waited
