"""Shared fixtures for the cross-package tests."""

import pytest


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny CPU models run fastest single-threaded, above all on a shared, loaded machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedded_model() -> str:
    """The path of the embedded default model (its absence is a broken install: a failure, not a skip)."""
    import ninfer

    path = ninfer.default_model_path()
    if path is None:
        pytest.fail("the embedded model is missing")
    return path
