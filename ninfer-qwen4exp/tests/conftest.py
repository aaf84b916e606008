"""Shared fixtures of the Qwen4Exp tests."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_cpu_thread):
    """Every Qwen4Exp test module runs single-threaded (the repository conftest's fixture, made automatic)."""
    yield
