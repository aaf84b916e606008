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


# -- the engine's failure tests (tests/test_engine_failures*.py) ------------------------------------------------
@pytest.fixture(scope="module")
def fault_model(one_cpu_thread):
    """The embedded model on the CPU shared by a module's failure cases (each leaves it all free), with the
    prompts' token ids and greedy tokens run alone (``ninfer.testing.faults.Prompts``)."""
    from ninfer.testing.faults import instance, prompts_alone

    inst = instance()
    yield prompts_alone(inst)
    inst.frontend.close()
