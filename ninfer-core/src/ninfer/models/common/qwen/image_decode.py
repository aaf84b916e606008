"""Image bytes to an RGB picture, bounded: what the vision preprocessing decodes, and nothing more.

- Only PNG, JPEG, WebP, GIF and BMP are read (the formats docs/serving.md lists). The format is told from the
  file's signature and only that format's Pillow plugin is opened, so bytes of any other kind (EPS, which may
  call Ghostscript, TIFF, ICO, PSD, ...) never reach a decoder, whatever type the client declared.
- The size is read from the header and checked against ``max_pixels`` before any pixel is decoded, so a small
  file that claims a huge picture (a decompression bomb) costs nothing. Pillow's own bomb check
  (``Image.MAX_IMAGE_PIXELS``, a warning then an error) is not involved: ``Image.open`` is not used, the bound
  here is the only one.
- A JPEG the model would shrink anyway is decoded at 1/2, 1/4 or 1/8 scale (``draft``), never below the size
  it is resized to; the bound applies to the size actually decoded.
- Transparency is composited on white in strips, so a transparent picture needs one RGB copy, not four RGBA.
- Memory goes back to the system, not to the allocator's arenas: ``mapped_float32`` puts a large array on its own
  anonymous mapping (unmapped when its last view is dropped, in whichever thread), and ``release_freed_memory``
  hands the heap's free pages back (Pillow decodes into 16 MiB blocks, which glibc serves from its arenas once
  its mmap threshold has risen, and keeps after they are freed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import math
import mmap
from functools import cache

import numpy as np
from PIL import BmpImagePlugin, GifImagePlugin, Image, ImageFile, ImageOps, JpegImagePlugin, PngImagePlugin

try:  # Pillow built without libwebp still reads the other formats
    from PIL import WebPImagePlugin
except ImportError:  # pragma: no cover
    WebPImagePlugin = None  # type: ignore[assignment]

FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"
# The bound when none is given: twice the published Qwen3.5 max_pixels (4096 x 4096), the bound its
# PreprocessConfig gives (``PreprocessConfig.max_decoded_pixels``).
DEFAULT_MAX_DECODED_PIXELS = 2 * 4096 * 4096
# EXIF orientations that swap width and height (a quarter turn, possibly mirrored).
_QUARTER_TURNS = (5, 6, 7, 8)
_ORIENTATION = 0x0112
_STRIP_PIXELS = 1 << 20  # pixels per strip when compositing transparency
_MAPPED_BYTES = 1 << 22  # arrays from this size on get their own mapping


class MediaError(ValueError):
    """An image or video the Frontend cannot use: undecodable, empty, too large or of unusable shape."""


class MediaOverLimit(MediaError):
    """An image or video frame with more pixels than the decoding limit."""


def _plugin(data: bytes) -> type[ImageFile.ImageFile] | None:
    """The Pillow plugin of the format ``data`` starts like, among the readable ones (None: another format)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return PngImagePlugin.PngImageFile
    if data.startswith(b"\xff\xd8\xff"):
        return JpegImagePlugin.JpegImageFile
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return GifImagePlugin.GifImageFile
    if data.startswith(b"BM"):
        return BmpImagePlugin.BmpImageFile
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and WebPImagePlugin is not None:
        return WebPImagePlugin.WebPImageFile
    return None


def open_image(data: bytes) -> ImageFile.ImageFile:
    """The image in ``data`` with its header read and no pixel decoded; MediaError when it is empty, of a format
    not read here, or a header the format's reader refuses."""
    if not data:
        raise MediaError("image data is empty")
    plugin = _plugin(data)
    if plugin is None:
        raise MediaError(f"image data ({len(data)} bytes) is not in an image format ninfer reads ({FORMAT_NAMES})")
    try:
        image = plugin(io.BytesIO(data))
    except Exception as exc:  # the plugins raise SyntaxError, struct.error, ValueError, ... on a bad header
        raise MediaError(f"image data ({len(data)} bytes) is not a readable {plugin.format} image: {exc}") from exc
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(f"image has no pixels ({width}x{height})")
    return image


def oriented_size(image: ImageFile.ImageFile) -> tuple[int, int]:
    """An opened image's (width, height) as displayed, as far as its header tells: the EXIF orientation (or XMP
    ``tiff:Orientation``) read when the file was opened applied, a quarter turn swapping the sides. A PNG's EXIF
    block may follow its pixel data, where only decoding finds it (Pillow decodes a PNG to look for it), so a
    PNG without EXIF before its pixels keeps its stored size here."""
    width, height = image.size
    if isinstance(image, PngImagePlugin.PngImageFile) and "exif" not in image.info:
        return width, height
    try:
        orientation = image.getexif().get(_ORIENTATION, 1)
    except Exception:  # a malformed EXIF block: exif_transpose will ignore it as well
        orientation = 1
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise MediaOverLimit(f"image is {width}x{height} = {width * height} pixels, more than the limit of "
                             f"{max_pixels} decoded pixels (media_max_pixels; ninfer serve --media-max-pixels)")


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS, at_least: tuple[int, int] | None = None) -> Image.Image:
    """Decode image bytes (the first frame of an animation) to an RGB image, EXIF orientation applied and
    transparency composited on white.

    ``at_least`` (width, height as displayed): the size the picture will be resized to; a JPEG at least twice
    as large on both sides is decoded at a reduced scale no smaller than it. Raises ``MediaError`` for data that
    is empty, of another format or undecodable, and ``MediaOverLimit`` when the decoded size would exceed
    ``max_pixels`` (checked from the header, before decoding)."""
    image = open_image(data)
    try:
        if at_least is not None and isinstance(image, JpegImagePlugin.JpegImageFile):
            reduce_jpeg_scale(image, at_least)
        check_pixels(*image.size, max_pixels)
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        rgb = to_rgb(image)
    except MediaError:
        image.close()
        raise
    except Exception as exc:  # truncated or corrupt pixel data surfaces only while decoding
        image.close()
        raise MediaError(f"image data could not be decoded ({image.format} {image.width}x{image.height}): "
                         f"{exc}") from exc
    if rgb is not image:
        image.close()  # its pixels go now, not when the garbage collector finds it
    return rgb


def reduce_jpeg_scale(image: JpegImagePlugin.JpegImageFile, at_least: tuple[int, int]) -> None:
    """Have an opened (not yet decoded) JPEG decode at 1/2, 1/4 or 1/8 scale, the smallest no smaller than
    ``at_least`` (width, height as displayed) on both sides, when it is at least twice that; ``image.size`` is the
    size it will decode to. No pixel is decoded here."""
    width, height = at_least
    if oriented_size(image) != image.size:
        width, height = height, width
    if image.width >= 2 * width and image.height >= 2 * height:
        image.draft(image.mode, (width, height))  # the largest reduction that stays >= (width, height)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency (alpha band or palette/colour-key transparency) composited on white, as the
    reference does (RGBA, alpha_composite over opaque white, RGB); an RGB image is returned as it is. Each
    pixel's result depends on that pixel alone, so a large picture is converted strip by strip."""
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rows = max(1, _STRIP_PIXELS // image.width)
    if rows >= image.height:
        return _composited(image)
    out = Image.new("RGB", image.size)
    for top in range(0, image.height, rows):
        out.paste(_composited(image.crop((0, top, image.width, min(top + rows, image.height)))), (0, top))
    return out


def _composited(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def mapped_float32(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array; a large one on its own anonymous mapping, whose pages go back to the
    system the moment its last view (a tensor made from it included) is dropped, in whichever thread: the heap
    would keep them when freed away from its top."""
    count = math.prod(shape)
    if count * 4 < _MAPPED_BYTES:
        return np.empty(shape, dtype=np.float32)
    return np.frombuffer(mmap.mmap(-1, count * 4), dtype=np.float32).reshape(shape)


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Return the free pages of every malloc arena to the system (glibc only; elsewhere nothing happens)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
