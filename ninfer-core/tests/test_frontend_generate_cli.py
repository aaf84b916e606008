"""``ninfer generate`` end to end on a real tiny Qwen3.5 artifact (random weights, real converter, CPU)."""

import pytest

from ninfer.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("generate")
    return str(convert_tiny(make_tiny_checkpoint(root / "hf", mtp=False), root / "tiny.ninfer"))


def test_chat_streams_reasoning_apart_and_reports_speed(tiny, capsys):
    rc = main(["generate", tiny, "--chat", "Hello there", "--max-tokens", "12", "--temperature", "0",
               "--ignore-eos", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    # the Qwen3.5 prompt opens <think>: output starts as reasoning, which goes to stderr when stdout is no terminal
    assert "[thinking]" not in out and "\n[thinking]\n" in err
    reasoning = err[err.index("[thinking]"):err.index("finish:")]
    assert "finish: length" in err and "12 generated tokens" in err
    assert "TTFT" in err and "tokens/s" in err
    # greedy is reproducible
    assert main(["generate", tiny, "--chat", "Hello there", "--max-tokens", "12", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
    again = capsys.readouterr()
    assert again.out == out and again.err[again.err.index("[thinking]"):again.err.index("finish:")] == reasoning


def test_raw_prompt_with_thinking_disabled_chat_and_errors(tiny, capsys, tmp_path):
    assert main(["generate", tiny, "--prompt", "The quick", "--max-tokens", "5", "--seed", "1",
                 "--device", "cpu"]) == 0
    assert "5 generated tokens" in capsys.readouterr().err
    assert main(["generate", tiny, "--chat", "Hi", "--no-think", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "[thinking]" not in out + err  # the template pre-filled an empty think block
    assert main(["generate", str(tmp_path / "missing.ninfer"), "--prompt", "x"]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert main(["generate", tiny, "--prompt", "x", "--no-think"]) == 2
    assert "--chat only" in capsys.readouterr().err
    assert main(["generate", tiny, "--chat", "x", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "chat template file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('nope') }}")
    assert main(["generate", tiny, "--chat", "x", "--chat-template", str(bad), "--device", "cpu"]) == 1
    assert "nope" in capsys.readouterr().err


def test_prefill_chunk_option(tiny, capsys):
    """A prompt split into 2-token prefill units generates what one unit does; 0 is a clear error."""
    args = ["generate", tiny, "--prompt", "The quick brown fox", "--max-tokens", "6", "--temperature", "0",
            "--ignore-eos", "--device", "cpu"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--prefill-chunk", "2"]) == 0
    assert capsys.readouterr().out == whole
    assert main([*args, "--prefill-chunk", "0"]) == 2
    assert "prefill_chunk must be >= 1" in capsys.readouterr().err


def test_default_prefill_chunk_by_device():
    from ninfer.contract.config import default_prefill_chunk

    assert default_prefill_chunk("cuda") == default_prefill_chunk("cuda:1") == 2048
    assert default_prefill_chunk("cpu") == 512


def test_logit_adjustment_flags(tiny, capsys):
    """--logit-bias +100 forces a token; the penalty flags reach SamplingParams, whose ranges are checked."""
    args = ["generate", tiny, "--prompt", "The quick", "--max-tokens", "4", "--temperature", "0", "--ignore-eos",
            "--device", "cpu"]
    assert main([*args, "--logit-bias", "100=100", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                 "--repetition-penalty", "1.2", "--min-p", "0.1", "--min-tokens", "2", "--stop-token-id", "7"]) == 0
    forced, err = capsys.readouterr()
    assert "4 generated tokens" in err
    assert main([*args, "--logit-bias", "100=100"]) == 0
    assert capsys.readouterr().out == forced  # +100 wins over every penalty
    assert main([*args, "--presence-penalty", "3"]) == 2
    assert "presence_penalty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--logit-bias", "nope"])
