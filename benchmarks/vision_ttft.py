"""Time to first token of a chat with one image, for benchmarks/vision.py: ``ninfer.Engine`` against transformers on
one random Qwen3_5ForConditionalGeneration checkpoint (written by ``vision_weights.write_vl_checkpoint``, converted
by the real converter).

Ours: a ChatInput with one image part and its MediaItem (JPEG bytes) submitted to an Engine started with the
vision feature required, the context cache off; TTFT = from just before ``submit`` (the Frontend decodes, resizes,
patchifies and renders the prompt there) to the first token event. transformers: the image decoded with PIL, its
AutoImageProcessor, the same chat as text with the image's placeholder run, tokenized, then
``generate(max_new_tokens=1)``; TTFT = all of that, with the preprocessing share reported. One warm-up request,
then ``--ttft-repeats`` requests, each with a different image of the same size.

Where this tree cannot run it, ours is ``skipped`` with the reason: an Engine that refuses to start with the
vision feature, or refuses the image request at ``submit``. A failure after that is an error.
"""

from __future__ import annotations

import io
import shutil
import statistics
import time
import traceback
from pathlib import Path

from benchmarks import vision_weights as vw

clock = time.perf_counter
QUESTION = "Describe this image in one sentence."


def run(args, device: str, vision: dict, workdir: Path) -> dict:
    from benchmarks.harness import plugin_host
    from ninfer_convert.convert import convert_checkpoint
    from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

    src, art = workdir / "hf", workdir / "model.ninfer"
    res: dict = {"text_shape": args.text_shape, "side": args.ttft_side, "repeats": args.ttft_repeats}
    need = 2.05 * vw.checkpoint_bytes(vw.vl_config(args.text_shape, vision, make_tokenizer_json()[1]))
    free = shutil.disk_usage(workdir).free
    if free < need:  # checkpoint and artifact side by side
        raise RuntimeError(f"{workdir} has {free / 1e9:.1f} GB free; the {args.text_shape} checkpoint and its "
                           f"artifact need about {need / 1e9:.1f} GB (pass --workdir)")
    t = clock()
    cfg = vw.write_vl_checkpoint(src, args.text_shape, vision, device)
    res["write_s"], res["checkpoint_bytes"] = clock() - t, vw.checkpoint_bytes(cfg)
    res["convert_s"] = convert_checkpoint(src, art, host=plugin_host()).seconds
    images = [vw.test_image(args.ttft_side, seed=i) for i in range(args.ttft_repeats + 1)]
    res["image_bytes"] = len(images[0])
    print(f"#   checkpoint {res['checkpoint_bytes'] / 1e9:.1f} GB written in {res['write_s']:.1f} s, converted in "
          f"{res['convert_s']:.1f} s", flush=True)
    try:
        res["ours"] = ours(art, images, device)
    except Exception as exc:
        traceback.print_exc()
        res["ours"] = {"error": f"{type(exc).__name__}: {exc}"}
    art.unlink(missing_ok=True)
    print("#   ours: " + _line(res["ours"]), flush=True)
    if args.hf:
        try:
            res["hf"] = transformers_ttft(src, images, device)
        except Exception as exc:  # the baseline is a comparison: keep ours
            traceback.print_exc()
            res["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
        print("#   transformers: " + _line(res["hf"]), flush=True)
    return res


def _summary(runs: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in runs[1:]]  # the first is the warm-up
    return {"ttft_ms": statistics.median(ttft) * 1e3, "ttft_ms_min": min(ttft) * 1e3, "runs": runs}


def ours(artifact: Path, images: list[bytes], device: str) -> dict:
    import ninfer
    from benchmarks.harness import close_engine
    from ninfer.contract.config import EngineConfig, StartupFeatures
    from ninfer.contract.events import GenerationResult, OutputDelta
    from ninfer.contract.prompt import ChatInput, MediaItem
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.engine.errors import RequestRejected

    t = clock()
    try:
        engine = ninfer.Engine(artifact, EngineConfig(device=device, max_concurrency=1, max_model_len=8192,
                                                      context_cache=False, features=StartupFeatures(vision=True)))
    except ValueError as exc:  # a Startup that cannot run the encoder refuses the feature
        return {"skipped": f"the Engine does not start with the vision feature: {type(exc).__name__}: {exc}"}
    start_s = clock() - t
    runs = []
    try:
        for image in images:
            chat = ChatInput(messages=({"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": QUESTION}]},),
                             media=(MediaItem(kind="image", data=image, mime_type="image/jpeg"),))
            request = GenerationRequest(input=chat, sampling=SamplingParams(max_tokens=1, temperature=0.0,
                                                                            ignore_eos=True))
            t = clock()
            try:
                handle = engine.submit(request)
            except RequestRejected as exc:
                return {"skipped": f"the Engine refuses a chat with an image: {type(exc).__name__}: {exc}",
                        "start_s": start_s}
            first, final = None, None
            for event in handle:
                if first is None and isinstance(event, OutputDelta) and event.token_ids:
                    first = clock()
                elif isinstance(event, GenerationResult):
                    final = event
            if final is None or final.error or first is None:
                raise RuntimeError(f"the image request ended without a token: "
                                   f"{final.error if final is not None else 'no result'}")
            runs.append({"ttft_s": first - t, "prompt_tokens": final.usage.prompt_tokens,
                         "engine_ttft_s": final.timings.time_to_first_token_s})
        prepare = []
        for image in images[1:]:  # the Frontend's share alone (decode, resize, patchify, template)
            t = clock()
            engine.frontend.prepare(ChatInput(messages=chat.messages, media=(MediaItem(kind="image", data=image),)))
            prepare.append(clock() - t)
    finally:
        close_engine(engine)
    return {**_summary(runs), "start_s": start_s, "prompt_tokens": runs[0]["prompt_tokens"],
            "prepare_ms": statistics.median(prepare) * 1e3}


def transformers_ttft(checkpoint: Path, images: list[bytes], device: str) -> dict:
    import torch
    import transformers
    from PIL import Image
    from tokenizers import Tokenizer

    from benchmarks.harness import sync

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t = clock()
    placement = {"device_map": device} if device.startswith("cuda") else {}
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=dtype, **placement)
    model.to(device).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint))
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    sync(device)
    res: dict = {"transformers": transformers.__version__, "load_s": clock() - t,
                 "processor": type(processor).__name__, "attn_implementation": model.config._attn_implementation}
    merge = model.config.vision_config.spatial_merge_size ** 2
    runs = []
    with torch.inference_mode():
        for image in images:
            sync(device)
            t = clock()
            pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
            grid = pixels["image_grid_thw"]
            text = (f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * (int(grid.prod()) // merge)}"
                    f"<|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
            ids = torch.tensor([tokenizer.encode(text).ids], device=device)
            prepared = clock()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 pixel_values=pixels["pixel_values"].to(device), image_grid_thw=grid.to(device),
                                 max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            sync(device)
            done = clock()
            if out.shape[1] != ids.shape[1] + 1:
                raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected 1")
            runs.append({"ttft_s": done - t, "prepare_s": prepared - t, "prompt_tokens": ids.shape[1]})
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {**res, **_summary(runs), "prompt_tokens": runs[0]["prompt_tokens"],
            "prepare_ms": statistics.median(r["prepare_s"] for r in runs[1:]) * 1e3}


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "error" in r:
        return f"FAILED: {r['error']}"
    return f"TTFT {r['ttft_ms']:.1f} ms (min {r['ttft_ms_min']:.1f}), {r['prompt_tokens']} prompt tokens, " \
           f"preparation {r['prepare_ms']:.1f} ms"


def markdown(t: dict) -> list[str]:
    if "write_s" not in t:
        return [f"## TTFT: FAILED: {t.get('error')}"]
    lines = [f"## TTFT, one {t['side']} x {t['side']} image ({t['text_shape']} text shape, "
             f"{t['checkpoint_bytes'] / 1e9:.1f} GB checkpoint, {t['repeats']} requests after a warm-up)", "",
             "| engine | TTFT ms (median) | min | prompt tokens | preparation ms (in the TTFT) |", "|---|---|---|---|---|"]
    for key, name in (("ours", "ninfer"), ("hf", "transformers")):
        r = t.get(key)
        if r is None:
            continue
        if "ttft_ms" not in r:
            lines.append(f"| {name} | {_line(r)} | | | |")
            continue
        lines.append(f"| {name} | {r['ttft_ms']:.1f} | {r['ttft_ms_min']:.1f} | {r['prompt_tokens']} "
                     f"| {r['prepare_ms']:.1f} |")
    return lines
