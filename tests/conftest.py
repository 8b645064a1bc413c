"""The suite keeps its gloo worker processes between tests (`LocalPool`): each `spawn_local` call still gets a
fresh process group and the caller's environment, but not a fresh Python that imports torch again. Under
pytest-xdist (pyproject's addopts) each test process keeps its own pool."""

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from autopar.runtime.launch import LocalPool

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes each spinning two OpenMP threads on two cores slow each other down 10x or more (a
    # single-process reference took 137 s instead of 5 s): one thread each, as the ranks have
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def kept_worker_processes() -> Iterator[LocalPool]:
    with LocalPool() as pool:
        yield pool


def pytest_collection_finish(session: pytest.Session) -> None:
    # every test module is imported now (torch, transformers, torch_geometric: ~0.5M objects that live to the
    # end): out of the cyclic collector's reach, as the pooled ranks do (runtime/launch.py `_freeze_survivors`),
    # so each full collection a test triggers traverses only what tests made since
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # back in reach before the interpreter's exit, which frees (and nanobind checks) them

