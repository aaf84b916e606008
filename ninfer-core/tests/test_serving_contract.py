"""``ninfer.Engine`` and its handle have the shapes a gateway holds them by (ninfer.contract.serving): every
member the Protocols declare exists, and every method takes the parameters the Protocol passes."""

from __future__ import annotations

import inspect

import pytest

from ninfer.contract.serving import RequestHandle, ServingEngine
from ninfer.engine.engine import Engine
from ninfer.engine.handle import GenerationHandle


def _members(proto: type) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_") or n == "__aiter__")


@pytest.mark.parametrize(("proto", "cls"), [(ServingEngine, Engine), (RequestHandle, GenerationHandle)],
                         ids=["engine", "handle"])
def test_the_engine_has_the_shape_the_gateway_holds(proto, cls):
    for name in _members(proto):
        declared = vars(proto)[name]
        if isinstance(declared, property):  # an attribute set at start, or a property
            continue
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        wanted = [p for p in inspect.signature(declared).parameters if p != "self"]
        given = inspect.signature(getattr(cls, name)).parameters
        assert all(p in given for p in wanted), f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))}"


def test_every_engine_attribute_the_gateway_reads_is_set_or_a_property():
    source = inspect.getsource(Engine)
    for name in _members(ServingEngine):
        if isinstance(vars(ServingEngine)[name], property):
            assert isinstance(vars(Engine).get(name), property) or f"self.{name} = " in source, name


def test_the_protocols_name_what_the_gateway_calls():
    assert {"submit", "prepare", "score", "metrics", "usage", "model_name", "max_model_len", "frontend",
            "vision_enabled", "memory"} == set(_members(ServingEngine))
    assert {"request_id", "__aiter__", "exception", "cancel", "close"} == set(_members(RequestHandle))
