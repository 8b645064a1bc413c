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


# what the pooled ranks' jobs import, imported once in the fork server their processes are forked from
# (LocalPool's `preload`): a rank then starts in a fork, not in ~5 s of CPU importing torch, the runtime and
# transformers again (about 35 rank processes per run)
PRELOAD = ("torch", "torch.distributed", "torch.export", "torch.export._trace", "torch._functorch.partitioners",
           "torch._inductor.codecache", "autopar.runtime.program", "autopar.compiler", "autopar.api", "autopar.graphs",
           "autopar.models", "autopar.hf_models", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "torch_geometric", "tests.runtime_cases")


@pytest.fixture(scope="session", autouse=True)
def kept_worker_processes() -> Iterator[LocalPool]:
    with LocalPool(preload=PRELOAD) as pool:
        yield pool


def pytest_collection_finish(session: pytest.Session) -> None:
    # every test module is imported now (torch, transformers, torch_geometric: ~0.5M objects that live to the
    # end): out of the cyclic collector's reach, as the pooled ranks do (runtime/launch.py `_freeze_survivors`),
    # so each full collection a test triggers traverses only what tests made since
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # back in reach before the interpreter's exit, which frees (and nanobind checks) them

