"""The suite keeps its gloo worker processes between tests (`LocalPool`): each `spawn_local` call still gets a
fresh process group and the caller's environment, but not a fresh Python that imports torch again. Under
pytest-xdist (pyproject's addopts) each test process keeps its own pool."""

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
