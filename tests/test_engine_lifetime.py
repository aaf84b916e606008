"""Leaving a generation early ends its request at once; interpreter exit ends a live engine cleanly.

On the embedded model (CPU). The handle object stays referenced in every case: it is the iteration that
ends, and its end alone must give back the request's slot and pages.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

import ninfer
from ninfer.contract import GenerationRequest, SamplingParams, TextInput
from ninfer.contract.events import FinishReason, GenerationStart, OutputDelta


@pytest.fixture(scope="module")
def engine(one_cpu_thread):
    with ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu",
                                                                        max_concurrency=2)) as eng:
        yield eng


def _long(engine) -> GenerationRequest:
    """Runs to the context limit unless it is cancelled (thousands of tokens: far longer than any test step)."""
    return GenerationRequest(input=TextInput(text="ROMEO:"),
                             sampling=SamplingParams(max_tokens=engine.max_model_len - 8, ignore_eos=True))


def _assert_cancelled_and_free(engine, handle) -> None:
    result = handle.result(timeout=120)  # a hang guard: a cancelled request ends within a unit or two
    assert result.finish_reason is FinishReason.CANCELLED, result
    assert result.usage.completion_tokens < engine.max_model_len - 8
    usage = engine.usage()
    assert usage.state_slots_used == 0 and usage.idle, usage  # what remains is the context cache's
    engine.clear_context_cache()
    assert engine.usage().all_free
    assert engine.metrics().outstanding == 0


def test_cancelling_the_consuming_task_cancels_the_request(engine):
    handle = engine.submit(_long(engine))

    async def consume(decoding: asyncio.Event) -> None:
        async for event in handle:
            if isinstance(event, OutputDelta):
                decoding.set()

    async def main() -> None:
        decoding = asyncio.Event()
        task = asyncio.create_task(consume(decoding))
        await decoding.wait()
        assert engine.usage().state_slots_used == 1  # resident and decoding
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _assert_cancelled_and_free(engine, handle)


def test_breaking_out_of_async_iteration_cancels_the_request(engine):
    handle = engine.submit(_long(engine))

    async def main() -> None:
        async for event in handle:
            if isinstance(event, OutputDelta):
                break
        # the abandoned iterator is closed by the event loop; wait for the result off the loop
        await asyncio.to_thread(_assert_cancelled_and_free, engine, handle)

    asyncio.run(main())


def test_closing_a_sync_iterator_cancels_the_request(engine):
    handle = engine.submit(_long(engine))
    it = iter(handle)
    assert isinstance(next(it), GenerationStart)
    assert isinstance(next(it), OutputDelta)
    it.close()
    _assert_cancelled_and_free(engine, handle)


def test_breaking_out_of_a_sync_loop_cancels_the_request(engine):
    handle = engine.submit(_long(engine))
    for event in handle:
        if isinstance(event, OutputDelta):
            break
    _assert_cancelled_and_free(engine, handle)


def test_iterating_to_the_end_still_completes_normally(engine):
    handle = engine.submit(GenerationRequest(input=TextInput(text="ROMEO:"),
                                             sampling=SamplingParams(max_tokens=4, ignore_eos=True)))
    events = list(handle)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert handle.result(timeout=60).finish_reason is FinishReason.LENGTH
    assert engine.metrics().outstanding == 0


_EXIT_SCRIPT = textwrap.dedent("""
    import ninfer
    from ninfer.contract import GenerationRequest, SamplingParams, TextInput

    engine = ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu"))
    handle = engine.submit(GenerationRequest(input=TextInput(text="ROMEO:"),
                                             sampling=SamplingParams(max_tokens=1000, ignore_eos=True)))
    events = iter(handle)  # kept: the request is not cancelled by the break below
    for i, event in enumerate(events):
        if i == 4:
            break
    print("left the loop", flush=True)
""")


@pytest.mark.parametrize("keep_iterator", [True, False])
def test_exiting_without_close_ends_the_worker_cleanly(keep_iterator):
    script = _EXIT_SCRIPT if keep_iterator else _EXIT_SCRIPT.replace("events = iter(handle)", "events = handle")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "left the loop" in proc.stdout, proc.stderr
    assert "terminate called" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
