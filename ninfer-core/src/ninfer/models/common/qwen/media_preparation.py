"""MediaPreparer: a request's images and videos planned from their headers, then decoded and preprocessed on the
Frontend's own TaskPool, at a lower CPU priority than the rest of the process.

``plan`` reads every item's headers (``media_plan``), on the caller's thread: formats, the pixel bound and each
item's exact grid are known before any pixel is decoded, so a request whose prompt cannot fit is refused
without decoding. ``prepare`` then makes one task per item (decode, resize, normalise, patchify, digest), so the
items of a request are prepared in parallel; their results are taken in order, and the first failure cancels
the tasks not yet started. Limits that need no header (encoded bytes, frame count) are checked first of all.
The pool is a bounded FIFO: a request waits for room, and since no task waits on another, room always comes.
``close`` lets the accepted tasks finish and joins the threads.

Decoding is the Frontend's heaviest CPU work and shares the cores with the engine worker, which runs the model
and must not wait: each pool thread runs its tasks ``MEDIA_NICE`` nice steps below the process (Linux sets a
thread's nice value on its own; raising it needs no privilege). A request of many large pictures then takes the
cores the engine leaves, instead of lengthening every other request's token gaps.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import attrs

from ninfer.contract.errors import EngineClosed
from ninfer.contract.prompt import MediaItem, VisionItem
from ninfer.core.task_pool import PoolClosed, Task, TaskPool
from ninfer.models.common.qwen.image_decode import MediaError, MediaOverLimit, release_freed_memory
from ninfer.models.common.qwen.media_plan import (
    MediaPlan,
    plan_image,
    plan_video,
    preprocess_encoded_image,
    preprocess_encoded_video,
)
from ninfer.models.common.qwen.media_prompt import MediaInputError, MediaTooLarge
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig

MAX_MEDIA_THREADS = 16
# Tasks waiting for a thread, over all requests; a request with more items waits for room as they run.
DEFAULT_MEDIA_QUEUE = 64
# Nice steps the media threads run below the process (the kernel's range ends at 19).
MEDIA_NICE = 10
# Placeholder tokens of one request's media together: the float32 pixel rows behind them are held until the
# request ends (24 KiB a token for Qwen3.5: 768 MiB here), and the context alone (262,144 tokens for Qwen3.5)
# would allow 6 GiB. Two pictures at the model's max_pixels (16,384 tokens each), or 16 full-HD ones.
DEFAULT_MAX_REQUEST_TOKENS = 32_768
_LOWEST_PRIORITY = 19


def default_media_threads() -> int:
    """Threads for media preparation: the CPUs this process may use, at most 4 (decoding shares the machine
    with tokenizing, the gateway and the engine worker)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def lower_thread_priority(steps: int) -> None:
    """Run the calling thread at least ``steps`` nice steps below the process's priority (Linux only: its
    threads have nice values of their own; elsewhere, where the call would name a process, nothing happens).
    Only lowers, which needs no privilege; a refusal (a seccomp filter, say) leaves the priority as it is."""
    if not sys.platform.startswith("linux") or steps <= 0:
        return
    thread = threading.get_native_id()
    try:
        target = min(_LOWEST_PRIORITY, os.getpriority(os.PRIO_PROCESS, os.getpid()) + steps)
        if os.getpriority(os.PRIO_PROCESS, thread) < target:
            os.setpriority(os.PRIO_PROCESS, thread, target)
    except OSError:
        pass


def _positive(_instance, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class MediaLimits:
    """What one media item, and one request's media together, may be. ``max_item_bytes``: encoded bytes of an
    image, or of all frames of a video; ``max_decoded_pixels``: width x height of an image or a frame as decoded,
    read from its header before decoding (None: the model's, ``PreprocessConfig.max_decoded_pixels``, twice the
    pixels it resizes to); ``max_video_frames``: sampled frames of a video (Qwen's video pipeline samples at
    most 768); ``max_request_tokens``: placeholder tokens of all of a request's images and videos, counted from
    their headers before decoding (None: ``DEFAULT_MAX_REQUEST_TOKENS``), which bounds the pixel rows a request
    holds to that many times ``PreprocessConfig.pixel_bytes_per_token``."""

    max_item_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    max_decoded_pixels: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    max_video_frames: int = attrs.field(default=768, validator=_positive)
    max_request_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))


def media_digest(item: MediaItem, config: PreprocessConfig, grid_thw: tuple[int, int, int]) -> str:
    """An item's identity: hex SHA-256 of what determines its pixel values (preprocessing is deterministic): the
    preprocessing settings, the grid, and the encoded bytes (a video: its frame rate and every frame, each behind
    its length). The bytes are several times smaller than the float32 pixel rows, so hashing them keeps the
    digest off the time to first token; the same picture in another encoding is another item (a cache miss,
    never a wrong hit)."""
    digest = hashlib.sha256(f"{item.kind};{config!r};{','.join(map(str, grid_thw))};{item.fps}".encode())
    for data in (item.data,) if item.kind == "image" else item.frames:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


class MediaPreparer:
    """Turns MediaItems into VisionItems on ``threads`` worker threads (see the module docstring)."""

    def __init__(self, config: PreprocessConfig, *, limits: MediaLimits | None = None, threads: int | None = None,
                 max_queued: int = DEFAULT_MEDIA_QUEUE) -> None:
        threads = default_media_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_MEDIA_THREADS:
            raise ValueError(f"media preparation takes 1..{MAX_MEDIA_THREADS} threads, got {threads!r}")
        self.config = config
        self.limits = MediaLimits() if limits is None else limits
        bound = self.limits.max_decoded_pixels
        self.max_decoded_pixels = config.max_decoded_pixels if bound is None else bound
        tokens = self.limits.max_request_tokens
        self.max_request_tokens = DEFAULT_MAX_REQUEST_TOKENS if tokens is None else tokens
        self._pool = TaskPool("ninfer-media", threads=threads, max_queued=max_queued)

    @property
    def threads(self) -> int:
        return self._pool.threads

    def check(self, media: Sequence[MediaItem]) -> None:
        """MediaTooLarge for an item over the limits that need no decoding."""
        limits = self.limits
        for index, item in enumerate(media):
            size = len(item.data) + sum(len(frame) for frame in item.frames)
            if size > limits.max_item_bytes:
                raise MediaTooLarge(f"media item {index} ({item.kind}) is {size} bytes, more than the limit of "
                                    f"{limits.max_item_bytes}")
            if item.kind == "video" and len(item.frames) > limits.max_video_frames:
                raise MediaTooLarge(f"media item {index} (video) has {len(item.frames)} frames, more than the limit "
                                    f"of {limits.max_video_frames}")

    def plan(self, media: Sequence[MediaItem]) -> list[MediaPlan]:
        """Each item's MediaPlan, from its headers alone (nothing is decoded); a failing item raises
        MediaInputError naming its index, MediaTooLarge over the pixel bound or once the items so far take more
        than ``max_request_tokens`` placeholder tokens."""
        plans: list[MediaPlan] = []
        tokens = 0
        for index, item in enumerate(media):
            with _naming(index, item):
                if item.kind == "image":
                    plans.append(plan_image(item.data, self.config, max_pixels=self.max_decoded_pixels))
                else:
                    plans.append(plan_video(item.frames, self.config, max_pixels=self.max_decoded_pixels))
            tokens += plans[-1].tokens
            if tokens > self.max_request_tokens:
                rows = tokens * self.config.pixel_bytes_per_token
                raise MediaTooLarge(
                    f"media items 0..{index} take {tokens} placeholder tokens ({rows / 2 ** 20:.0f} MiB of pixel "
                    f"rows), more than the limit of {self.max_request_tokens} for one request's images and videos "
                    "(media_max_tokens; ninfer serve --media-max-tokens)")
        return plans

    def prepare(self, media: Sequence[MediaItem], plans: Sequence[MediaPlan] | None = None) -> list[VisionItem]:
        """The VisionItems of ``media``, in order, by their ``plans`` (``plan``'s, made here when not given); a
        failing item raises MediaInputError (MediaTooLarge over a pixel limit) naming its index."""
        plans = self.plan(media) if plans is None else plans
        tasks: list[Task[VisionItem]] = []
        try:
            for item, plan in zip(media, plans, strict=True):
                task = Task(partial(self._prepare_one, item, plan))
                try:
                    self._pool.submit(task)
                except PoolClosed as exc:
                    raise EngineClosed("the frontend is closed: it prepares no more media") from exc
                tasks.append(task)
            results = []
            for index, (item, task) in enumerate(zip(media, tasks, strict=True)):
                with _naming(index, item):
                    results.append(task.result())
            return results
        finally:
            for task in tasks:  # after a failure: the items not started never run
                task.cancel()

    def _prepare_one(self, item: MediaItem, plan: MediaPlan) -> VisionItem:
        lower_thread_priority(MEDIA_NICE)
        cfg, max_pixels = self.config, self.max_decoded_pixels
        try:
            if item.kind == "image":
                prepared = preprocess_encoded_image(item.data, cfg, max_pixels=max_pixels, plan=plan)
            else:
                prepared = preprocess_encoded_video(item.frames, cfg, max_pixels=max_pixels, plan=plan)
        finally:
            release_freed_memory()  # the decoded pictures are freed: their pages go back, not to the arenas
        return VisionItem(kind=item.kind, pixel_values=prepared.pixel_values, grid_thw=prepared.grid_thw,
                          digest=media_digest(item, cfg, prepared.grid_thw))

    def close(self, timeout: float | None = None) -> None:
        """Refuse new media, finish what was accepted and join the threads."""
        self._pool.shutdown(timeout=timeout)


@contextmanager
def _naming(index: int, item: MediaItem) -> Iterator[None]:
    """Media errors raised inside as the Frontend's errors, naming the item."""
    try:
        yield
    except MediaOverLimit as exc:
        raise MediaTooLarge(f"media item {index} ({item.kind}): {exc}") from exc
    except MediaError as exc:
        raise MediaInputError(f"media item {index} ({item.kind}): {exc}") from exc
