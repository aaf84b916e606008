"""``ninfer.Engine`` over a real converted ``.ninfer`` artifact (tiny Qwen3.5, CPU): plugin dispatch,
Startup, Frontend and Program wired end to end, and the clear errors of a bad start or bad request."""

from __future__ import annotations

import pytest

from ninfer.contract import EngineConfig
from ninfer.contract.events import FinishReason, GenerationResult, GenerationStart
from ninfer.contract.prompt import ChatInput, TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.errors import EngineClosed, InputTooLong, Unrepresentable

pytest.importorskip("transformers")
pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer_qwen35.testing.checkpoints import convert_tiny

    d = tmp_path_factory.mktemp("tiny")
    return convert_tiny(d / "ckpt", d / "tiny.ninfer")


def test_engine_serves_a_converted_artifact(artifact):
    import ninfer

    with ninfer.Engine(artifact, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                     max_model_len=256)) as eng:
        assert eng.model_name and eng.max_model_len == 256
        assert eng.instance.program.max_model_len == 256  # Startup planned the KV pool for it
        chat = ChatInput(messages=[{"role": "user", "content": "Hello there"}])
        hs = [eng.submit(GenerationRequest(input=chat, sampling=SamplingParams(max_tokens=6, seed=s)))
              for s in (1, 1, 2)]
        runs = [list(h) for h in hs]
        for evs in runs:
            assert isinstance(evs[0], GenerationStart) and isinstance(evs[-1], GenerationResult)
            assert evs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        # Same seed, same tokens, whatever the batch neighbours (artifact sampling defaults apply).
        assert runs[0][-1].token_ids == runs[1][-1].token_ids
        assert eng.usage().idle and eng.metrics().outstanding == 0
        eng.clear_context_cache()
        assert eng.usage().all_free
        with pytest.raises(InputTooLong):
            eng.submit(GenerationRequest(input=TextInput(token_ids=(1,) * 256)))
        with pytest.raises(Unrepresentable):
            eng.submit(GenerationRequest(input=TextInput(token_ids=(10**6,))))
    assert not eng._core.thread.is_alive()
    with pytest.raises(EngineClosed):
        eng.submit(GenerationRequest(input=TextInput(token_ids=(1, 2))))


def test_bad_start_is_a_clear_error(artifact, tmp_path):
    from ninfer import Engine

    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(tmp_path / "missing.ninfer", EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="purpose"):
        Engine(artifact, EngineConfig(device="cpu"), purpose="scoring")
    with pytest.raises(ValueError, match="max_concurrency"):
        Engine(artifact, EngineConfig(max_concurrency=9, device="cpu"))
