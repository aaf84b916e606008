"""Shared fixtures for the cross-package tests."""

import pytest


# -- the engine's failure tests (tests/test_engine_failures*.py) ------------------------------------------------
@pytest.fixture(scope="module")
def fault_model(one_cpu_thread):
    """The embedded model on the CPU shared by a module's failure cases (each leaves it all free), with the
    prompts' token ids and greedy tokens run alone (``ninfer.testing.faults.Prompts``)."""
    from ninfer.testing.faults import instance, prompts_alone

    inst = instance()
    yield prompts_alone(inst)
    inst.frontend.close()
