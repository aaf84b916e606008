"""Bounded image decoding (``image_decode``) and what the media pool gives back.

- the default pixel bound is the model's: twice its preprocessor's ``max_pixels``;
- a decompression bomb (a 9400 x 9400 PNG of under 100 KB) is refused from its header, before decoding,
  without growing the process (in a subprocess under an address-space limit);
- only PNG, JPEG, WebP, GIF and BMP reach a decoder: EPS, TIFF, ICO and PSD bytes are refused by their
  signature, whatever type they were sent as, and Pillow's own bomb check neither warns nor decides;
- a large JPEG is decoded at a reduced scale, its grid still the full picture's;
- after a burst of large legal images the process is back near its baseline (the decoded pictures and the
  pixel rows return their memory; an idle pool thread keeps no result alive).
- the pool's threads decode ``MEDIA_NICE`` steps below the process's priority (Linux), which only lowers.
"""

from __future__ import annotations

import gc
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
import zlib

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from ninfer.contract.prompt import MediaItem
from ninfer.models.common.qwen.image_decode import (
    DEFAULT_MAX_DECODED_PIXELS,
    MediaError,
    MediaOverLimit,
    decode_image,
    to_rgb,
)
from ninfer.models.common.qwen.media_plan import preprocess_encoded_image
from ninfer.models.common.qwen.media_preparation import MediaLimits, MediaPreparer
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig, preprocess_image

QWEN35 = PreprocessConfig(max_pixels=16_777_216)  # the published preprocessor's longest_edge
SMALL = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)  # resizes modest pictures down


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def gradient(width: int, height: int) -> Image.Image:
    """A smooth picture: a reduced-scale JPEG decode of it stays close to the full one."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    pixels = np.stack([x + 0 * y, 0 * x + y, (x + y) / 2], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def bomb_png(side: int = 9400, *, rows: int | None = None, idat: bytes | None = None) -> bytes:
    """A side x side palette PNG, every pixel transparent index 0: tens of KB that decode to side**2 pixels
    (``rows``: only that many rows of data; ``idat``: this instead of the compressed rows)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer, row = zlib.compressobj(9), b"\x00" * (side + 1)  # filter byte, then one index per pixel
    if idat is None:
        idat = b"".join(packer.compress(row) for _ in range(side if rows is None else rows)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 3, 0, 0, 0))
            + chunk(b"PLTE", b"\xff\x00\x00") + chunk(b"tRNS", b"\x00") + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


# ---------------------------------------------------------------- the bound


def test_the_default_bound_is_twice_what_the_model_resizes_to():
    assert QWEN35.max_decoded_pixels == 2 * 16_777_216 == DEFAULT_MAX_DECODED_PIXELS
    assert SMALL.max_decoded_pixels == 2 * 128 * 128
    preparer = MediaPreparer(SMALL, threads=1)
    try:
        assert MediaLimits().max_decoded_pixels is None and preparer.max_decoded_pixels == 2 * 128 * 128
    finally:
        preparer.close()
    preparer = MediaPreparer(SMALL, limits=MediaLimits(max_decoded_pixels=10), threads=1)
    try:
        assert preparer.max_decoded_pixels == 10
    finally:
        preparer.close()
    with pytest.raises(ValueError, match="max_decoded_pixels"):
        MediaLimits(max_decoded_pixels=0)


def test_a_bomb_png_is_refused_from_its_header():
    data = bomb_png()
    assert len(data) < 150_000
    with pytest.raises(MediaOverLimit, match="9400x9400 = 88360000 pixels, more than the limit of 33554432 "
                                             r"decoded pixels \(media_max_pixels; ninfer serve --media-max-pixels\)"):
        preprocess_encoded_image(data, QWEN35, max_pixels=QWEN35.max_decoded_pixels)


# ---------------------------------------------------------------- formats


def _psd() -> bytes:
    return b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, 64, 64, 8, 3) + bytes(64)


@pytest.mark.parametrize("fmt", ["EPS", "TIFF", "ICO", "PSD"])
def test_other_formats_are_refused_naming_the_readable_ones(fmt, monkeypatch):
    opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append(self))
    data = _psd() if fmt == "PSD" else encoded(Image.new("RGB", (16, 16), (1, 2, 3)), fmt)
    with pytest.raises(MediaError, match=r"not in an image format ninfer reads \(PNG, JPEG, WebP, GIF or BMP\)"):
        decode_image(data)
    with pytest.raises(MediaError, match="PNG, JPEG, WebP, GIF or BMP"):
        preprocess_encoded_image(data, SMALL)
    assert opened == []  # the EPS reader (which may run Ghostscript) was never reached


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_listed_formats_decode(fmt):
    picture = gradient(40, 24)
    prepared = preprocess_encoded_image(encoded(picture, fmt), SMALL)
    assert prepared.grid_thw == preprocess_image(picture, SMALL).grid_thw


def test_pillow_s_own_bomb_check_neither_warns_nor_decides():
    """A header between Pillow's warning and error thresholds, under a bound raised above both: no
    DecompressionBombWarning; the broken pixel data is what fails. Over the bound: our refusal, naming it."""
    claim = bomb_png(side=10_000, idat=b"not zlib")  # over MAX_IMAGE_PIXELS (89 M), under twice it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(MediaError, match="could not be decoded") as info:
            decode_image(claim, max_pixels=10 ** 9)
    assert not isinstance(info.value, MediaOverLimit)
    with pytest.raises(MediaOverLimit, match="--media-max-pixels"):
        decode_image(bomb_png(side=20_000, rows=1), max_pixels=DEFAULT_MAX_DECODED_PIXELS)


# ---------------------------------------------------------------- reduced decoding


def test_a_large_jpeg_is_decoded_at_reduced_scale_with_the_full_grid():
    picture = gradient(1600, 1200)
    data = encoded(picture, "JPEG", quality=95)
    full = preprocess_image(decode_image(data), SMALL)
    reduced = preprocess_encoded_image(data, SMALL, max_pixels=400 * 300)  # 1/4 scale fits, full size does not
    assert reduced.grid_thw == full.grid_thw
    assert float((reduced.pixel_values - full.pixel_values).abs().mean()) < 0.02
    with pytest.raises(MediaOverLimit, match="1600x1200"):  # no reduced decoding for a PNG
        preprocess_encoded_image(encoded(picture, "PNG"), SMALL, max_pixels=400 * 300)


def test_a_rotated_jpeg_takes_its_displayed_size():
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter: 600 wide, 1600 high
    data = encoded(gradient(1600, 600), "JPEG", exif=exif.tobytes())
    expected = preprocess_image(decode_image(data), SMALL)
    assert decode_image(data).size == (600, 1600)
    assert preprocess_encoded_image(data, SMALL, max_pixels=10 ** 6).grid_thw == expected.grid_thw


def test_transparency_is_composited_in_strips_exactly():
    rng = np.random.default_rng(3)
    rgba = Image.fromarray(rng.integers(0, 256, (1100, 1000, 4), dtype=np.uint8), "RGBA")  # > one strip
    whole = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    assert np.array_equal(np.asarray(to_rgb(rgba)), np.asarray(whole))
    palette = rgba.convert("P")
    palette.info["transparency"] = 7
    whole = Image.alpha_composite(Image.new("RGBA", palette.size, (255, 255, 255, 255)),
                                  palette.convert("RGBA")).convert("RGB")
    assert np.array_equal(np.asarray(to_rgb(palette)), np.asarray(whole))


# ---------------------------------------------------------------- memory comes back


def test_an_idle_pool_thread_keeps_no_result_alive():
    preparer = MediaPreparer(SMALL, threads=2)
    try:
        items = preparer.prepare([MediaItem(kind="image", data=encoded(gradient(150, 100), "PNG"))] * 2)
        rows = [weakref.ref(item.pixel_values) for item in items]
        del items
        gc.collect()
        assert [ref() for ref in rows] == [None, None]
    finally:
        preparer.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have nice values of their own on Linux")
def test_media_threads_decode_at_a_lower_priority(monkeypatch):
    """Every decode runs on a pool thread MEDIA_NICE steps below the process (the engine worker's priority);
    the caller's thread keeps its own."""
    from ninfer.models.common.qwen import media_plan
    from ninfer.models.common.qwen.media_preparation import MEDIA_NICE

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen, decode = [], media_plan.decode_image

    def watched(data, **options):
        seen.append((threading.current_thread().name, nice()))
        return decode(data, **options)

    monkeypatch.setattr(media_plan, "decode_image", watched)
    before = nice()
    preparer = MediaPreparer(SMALL, threads=2)
    try:
        preparer.prepare([MediaItem(kind="image", data=encoded(gradient(64, 48), "PNG"))] * 6)
        preparer.prepare([MediaItem(kind="video", frames=[encoded(gradient(64, 48), "PNG")] * 3)])
    finally:
        preparer.close()
    assert MEDIA_NICE > 0 and len(seen) == 9
    process = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert {(name.startswith("ninfer-media"), level) for name, level in seen} == {(True, min(19, process + MEDIA_NICE))}
    assert nice() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have nice values of their own on Linux")
def test_lowering_a_thread_s_priority_only_lowers():
    from ninfer.models.common.qwen.media_preparation import lower_thread_priority

    levels = []

    def run(start: int) -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, start)
        lower_thread_priority(5)
        levels.append(os.getpriority(os.PRIO_PROCESS, me))

    process = os.getpriority(os.PRIO_PROCESS, os.getpid())
    for start in (process, 19):
        thread = threading.Thread(target=run, args=(start,))
        thread.start()
        thread.join()
    assert levels == [min(19, process + 5), 19]


# One subprocess (it imports torch once) measures both: first a burst of large legal images, then, under an
# address-space limit of 1 GiB above the process's size, the request of 16 bomb PNGs.
_SCRIPT = textwrap.dedent("""
    import gc, io, json, resource, sys
    from PIL import Image
    from ninfer.contract.prompt import MediaItem
    from ninfer.models.common.qwen.media_preparation import MediaPreparer
    from ninfer.models.common.qwen.media_prompt import MediaInputError
    from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))

    def picture(seed):
        image = Image.new("P", (2000, 2000), seed % 2)
        image.putpalette([255, 0, 0, 0, 0, 255])
        out = io.BytesIO()
        image.save(out, "PNG", transparency=0)
        return out.getvalue()

    preparer = MediaPreparer(PreprocessConfig(max_pixels=16_777_216), threads=2)
    small = io.BytesIO()
    Image.new("RGB", (64, 64)).save(small, "PNG")
    preparer.prepare([MediaItem(kind="image", data=small.getvalue())] * 4)  # both threads and their arenas warm
    pictures = [picture(k) for k in range(4)]
    gc.collect()
    before = status("VmRSS")
    items = preparer.prepare([MediaItem(kind="image", data=data) for data in pictures])
    burst = {"held": sum(item.pixel_values.numel() * 4 for item in items)}
    del items
    gc.collect()
    burst["growth"] = status("VmRSS") - before

    bomb = open(sys.argv[1], "rb").read()
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (1 << 30), resource.RLIM_INFINITY))
    before = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
            f.write("5")
        peak = "VmHWM"
    except OSError:  # not allowed here: what stays resident afterwards
        peak = "VmRSS"
    try:
        preparer.prepare([MediaItem(kind="image", data=bomb)] * 16)
        bombs = {"error": None}
    except MediaInputError as exc:
        bombs = {"error": type(exc).__name__, "message": str(exc)}
    bombs["peak_growth"] = status(peak) - before
    preparer.close()
    print(json.dumps({"burst": burst, "bombs": bombs}))
""")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    path.write_bytes(bomb_png())
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sixteen_bombs_cost_no_memory(measured):
    """The issue's request: 16 bomb PNGs (9400 x 9400, under 100 KB each) in one request, refused before
    decoding: the process's peak does not grow (the old decoder ran into the 1 GiB limit)."""
    bombs = measured["bombs"]
    assert bombs["error"] == "MediaTooLarge", bombs
    assert "--media-max-pixels" in bombs["message"]
    assert bombs["peak_growth"] < 64 << 20, bombs


def test_a_burst_of_large_images_gives_its_memory_back(measured):
    """Four 2000 x 2000 transparent pictures (about 95 MB of pixel rows each, more while decoding): once their
    rows are dropped the process is back within 64 MiB of where it started (the old decoder kept ~280 MB)."""
    burst = measured["burst"]
    assert burst["held"] > 300 << 20
    assert burst["growth"] < 64 << 20, burst
