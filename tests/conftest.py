"""The suite keeps its gloo worker processes between tests (`LocalPool`): each `spawn_local` call still gets a
fresh process group and the caller's environment, but not a fresh Python that imports torch again."""

from collections.abc import Iterator

import pytest

from autopar.runtime.launch import LocalPool


@pytest.fixture(scope="session", autouse=True)
def kept_worker_processes() -> Iterator[LocalPool]:
    with LocalPool() as pool:
        yield pool
