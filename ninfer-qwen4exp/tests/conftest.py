"""Shared fixtures of the Qwen4Exp tests."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny CPU models run fastest single-threaded, above all on a shared, loaded machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
