"""Frontend resources from a checkpoint directory: tokenizer.json, chat template, generation defaults,
special token ids and media geometry, as the artifact stores them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from ninfer_convert.source import ConversionError, read_json


@attrs.frozen(kw_only=True)
class FrontendFiles:
    tokenizer_json: bytes
    chat_template: str | None
    generation_config: dict[str, Any]
    special_tokens: dict[str, int]
    eos_token_ids: tuple[int, ...]
    media: dict[str, Any] | None
    max_token_id: int


def _chat_template(src: Path) -> str | None:
    jinja = src / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    cfg_path = src / "tokenizer_config.json"
    if not cfg_path.exists():
        return None
    template = read_json(cfg_path, "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # older form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ConversionError(f"{cfg_path}: chat_template must be a string, got {type(template).__name__}")
    return template


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ConversionError(f"{where} must be a token id or a list of ids, got {value!r}")
    return tuple(items)


def read_frontend(src: Path, config: dict[str, Any], *, with_media: bool) -> FrontendFiles:
    tok_path = src / "tokenizer.json"
    if not tok_path.exists():
        raise ConversionError(f"tokenizer.json not found in {src}; the artifact must carry the tokenizer")
    raw = tok_path.read_bytes()
    tok = read_json(tok_path, "tokenizer.json")
    if not isinstance(tok, dict) or not isinstance(tok.get("model"), dict):
        raise ConversionError(f"{tok_path} is not a tokenizers JSON file (no 'model' section)")
    vocab = tok["model"].get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    special: dict[str, int] = {}
    for t in tok.get("added_tokens") or []:
        ids.append(t["id"])
        if t.get("special"):
            special[t["content"]] = t["id"]
    gen_path = src / "generation_config.json"
    generation = read_json(gen_path, "generation_config.json") if gen_path.exists() else {}
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    eos = _ids(generation.get("eos_token_id"), "generation_config.json eos_token_id") or _ids(
        text_cfg.get("eos_token_id", config.get("eos_token_id")), "config.json eos_token_id")
    media = None
    if with_media:
        pre = src / "preprocessor_config.json"
        media = read_json(pre, "preprocessor_config.json") if pre.exists() else None
        if media is None:
            raise ConversionError(f"the checkpoint has vision weights but no preprocessor_config.json in {src}")
    return FrontendFiles(tokenizer_json=raw, chat_template=_chat_template(src), generation_config=generation,
                         special_tokens=special, eos_token_ids=eos, media=media, max_token_id=max(ids, default=-1))
