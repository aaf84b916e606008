"""The context cache's options: EngineConfig validates them naming the field, ``Engine`` takes them as
keywords (the model-side ones reach the Startup), ``Engine.from_instance`` takes the engine-side ones and
refuses the model-side ones."""

from __future__ import annotations

import re

import pytest

import ninfer
import ninfer.engine.startup
from ninfer.contract import EngineConfig, ModelInstance, StartupOptions
from ninfer.contract.config import MODEL_KNOBS

BAD = [("context_cache", None), ("context_cache", 1), ("context_cache", "yes"), ("checkpoint_grid", 0),
       ("checkpoint_grid", -4), ("checkpoint_grid", 2.5), ("checkpoint_grid", True), ("checkpoint_slots", -1),
       ("checkpoint_slots", "2"), ("cache_host_budget_bytes", -1), ("cache_host_budget_bytes", 1.0)]


@pytest.mark.parametrize("field,value", BAD)
def test_a_bad_cache_option_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        EngineConfig(**{field: value})
    if value is not None:  # a keyword left None takes the default
        with pytest.raises(ValueError, match=rf"^{field} must be"):
            ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", **{field: value}))


def test_defaults_and_which_side_owns_each_option():
    config = EngineConfig()
    assert (config.context_cache, config.checkpoint_grid, config.checkpoint_slots,
            config.cache_host_budget_bytes) == (True, None, None, None)
    assert {"checkpoint_slots", "cache_host_budget_bytes"} <= set(MODEL_KNOBS)
    assert "context_cache" not in MODEL_KNOBS and "checkpoint_grid" not in MODEL_KNOBS
    assert EngineConfig(checkpoint_slots=0,
                        cache_host_budget_bytes=0).checkpoint_slots == 0  # host only / none


def test_engine_keywords_reach_the_config_and_the_startup(monkeypatch):
    seen: list[StartupOptions] = []
    build = ninfer.engine.startup.build_instance

    def recording(model, options, **kw):
        seen.append(options)
        return build(model, options, **kw)
    monkeypatch.setattr(ninfer.engine.startup, "build_instance", recording)
    with ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", max_concurrency=1,
                                                                        context_cache=False,
                                                                        checkpoint_grid=64,
                                                                        checkpoint_slots=1,
                                                                        cache_host_budget_bytes=1 << 20)) as engine:
        c = engine.config
        assert (c.context_cache, c.checkpoint_grid, c.checkpoint_slots, c.cache_host_budget_bytes) == \
            (False, 64, 1, 1 << 20)
    (options,) = seen
    assert (options.context_cache, options.checkpoint_slots, options.cache_host_budget_bytes) == (False, 1, 1 << 20)


def test_from_instance_takes_the_engine_side_options():
    from ninfer.engine.startup import build_instance

    instance, _, artifact = build_instance(ninfer.default_model_path(), StartupOptions(device="cpu",
                                                                                      max_concurrency=1))
    try:
        with ninfer.Engine.from_instance(instance, ninfer.EngineConfig(max_concurrency=1, device="cpu",
                                                                       context_cache=False,
                                                                       checkpoint_grid=32)) as engine:
            assert (engine.config.context_cache, engine.config.checkpoint_grid) == (False, 32)
    finally:
        artifact.close()


def test_from_instance_refuses_the_model_side_options_and_bad_values():
    bare = ModelInstance(architecture="none", config=None, model=None, parameters=None, frontend=None,
                         program=None)
    with pytest.raises(ValueError, match="checkpoint_grid must be >= 1, got 0"):
        ninfer.Engine.from_instance(bare, ninfer.EngineConfig(checkpoint_grid=0))
    with pytest.raises(ValueError, match="already built; startup options checkpoint_slots, cache_host_budget_bytes"):
        ninfer.Engine.from_instance(bare, config=EngineConfig(checkpoint_slots=2, cache_host_budget_bytes=0))
    with pytest.raises(ValueError, match="has no Program"):  # the cache keywords themselves were accepted
        ninfer.Engine.from_instance(bare, ninfer.EngineConfig(device="cpu", context_cache=False,
                                                              checkpoint_grid=8))
