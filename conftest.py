"""Repository-wide pytest setup."""

import os

import pytest

# Triton kernels run under the interpreter on machines without a GPU.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu tests on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- the embedded model on the CPU, for any package's tests ------------------------------------------------------
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
