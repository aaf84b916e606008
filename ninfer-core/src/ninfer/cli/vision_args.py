"""Vision's command-line options: ``--vision {auto,on,off}`` for ``ninfer generate`` and ``ninfer serve``
(``StartupFeatures.vision`` None / True / False), and the media ``ninfer generate`` sends: ``--image FILE``
(repeatable) and ``--video FRAME [FRAME ...]`` (one video per option, its sampled frames as image files in time
order) with ``--video-fps``. The images, then the videos, go into the user message before its text.

Light at import (argparse and the contracts only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

import argparse
import mimetypes
from typing import Any

import attrs

from ninfer.cli.number_args import positive_number
from ninfer.contract.config import StartupFeatures
from ninfer.contract.prompt import MediaItem

VISION_SETTINGS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def add_vision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vision", choices=tuple(VISION_SETTINGS), default="auto",
                        help="the vision encoder: auto binds it when the artifact has one, on requires it (the "
                             "start fails without it), off leaves it unread (requests with images or videos are "
                             "refused)")


def with_vision(features: StartupFeatures, args: argparse.Namespace) -> StartupFeatures:
    """``features`` with the ``--vision`` setting."""
    return attrs.evolve(features, vision=VISION_SETTINGS[args.vision])


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("images and videos (with --chat or --chat-file; need a model with vision)")
    group.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image file for the user message (repeatable; in order, before the text)")
    group.add_argument("--video", action="append", nargs="+", default=[], metavar="FRAME",
                       help="one video as its sampled frames, image files in time order (repeatable: one video "
                            "per --video; after the images, before the text)")
    group.add_argument("--video-fps", type=positive_number, metavar="FPS",
                       help="the rate the --video frames were sampled at, frames per second (default: the "
                            "model's)")


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{option}: file not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    if not data:
        raise ValueError(f"{option}: {path} is empty")
    return data


def _image_type(path: str) -> str | None:
    """The image type the file's name suggests (the Frontend decodes by content; this is a hint)."""
    guess = mimetypes.guess_type(path)[0]
    return guess if guess is not None and guess.startswith("image/") else None


def media_from_args(args: argparse.Namespace) -> tuple[MediaItem, ...]:
    """The ``--image`` files, then one item per ``--video``, read whole; a missing, unreadable or empty file, or
    ``--video-fps`` without ``--video``, is a ValueError naming the option."""
    if args.video_fps is not None and not args.video:
        raise ValueError("--video-fps needs --video")
    images = [MediaItem(kind="image", data=_read(p, "--image"), mime_type=_image_type(p)) for p in args.image]
    videos = [MediaItem(kind="video", frames=[_read(p, "--video") for p in frames], fps=args.video_fps)
              for frames in args.video]
    return (*images, *videos)


def user_content(text: str, media: tuple[MediaItem, ...]) -> str | list[dict[str, Any]]:
    """The user message's content: the text alone, or a part marking each media item (in order) then the text."""
    if not media:
        return text
    return [*({"type": item.kind} for item in media), {"type": "text", "text": text}]


def check_model_sees(model: str, args: argparse.Namespace) -> None:
    """``--image`` / ``--video`` need a model with a vision tower: the artifact's header says whether it has one,
    read before (and without) its weights. A file that is no artifact is left to the engine's start to report."""
    if not (args.image or args.video):
        return
    from ninfer.artifact.format import ArtifactError
    from ninfer.artifact.reader import open_artifact

    try:
        with open_artifact(model, verify=False) as artifact:
            features = artifact.features
    except ArtifactError:
        return
    if "vision" not in features:
        option = "--image" if args.image else "--video"
        raise ValueError(f"{option}: {model} is a text-only model (its artifact has no vision tower); images and "
                         f"videos need a model with vision")
