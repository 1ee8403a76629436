"""The checkpoint reader interface: one row per layout, as vLLM's model registry keeps one
per architecture. `model/checkpoint.py` holds the ordered list (`READERS`); a path's layout
is the first reader that claims it.

A reader says
  * `claims(path)`: whether the path is in its layout (a GGUF file, a directory whose
    config.json names a family or a model_type it reads);
  * `read(path, **flags)`: the native model it makes (on CPU, fp32, eval mode);
  * `flags`: what `recur convert` may pass to `read` besides the path, each a `Flag`;
  * `packs`: the weight precisions `read(path, weights=...)` packs from the file's own
    blocks (GGUF: int4, int8); `exact(path)`: those of them that keep the file's weights
    exactly, which `--precision auto` may pick (GGUF: int4 for a file of Q4 blocks);
  * its chat template: HF's files by default (`chat_template`), with the turn stops
    `turn_stops(path)` gives where generation_config.json names none; a layout that keeps
    the template inside (GGUF) reads its own.
Converting is the same for every reader: read, then write the native layout
(`model/convert.py`). Adding a layout is one module with its `READER` and one line in the
list. This module knows no layout; nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .chat_template import ChatTemplate, ChatTemplateError
from .family import LanguageModel
from .hf_files import json_file

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class Flag:
    """A `recur convert` option a reader's `read` takes: --name-with-dashes, or, for a bool,
    --name / --no-name."""

    name: str
    type: type
    help: str = ""


TGT_LEN = Flag("tgt_len", int, "serving segment length (the chunk a request runs in)")


def _no_stops(path: Path) -> list[str]:
    return []


def _none_exact(path: Path) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Reader:
    name: str  # the layout's name, e.g. "hf-ssm"
    describes: str  # what it reads, for `recur convert --help`
    claims: Callable[[Path], bool]
    read: Callable[..., LanguageModel]
    flags: tuple[Flag, ...] = ()
    # the template a layout keeps inside its file (GGUF); None: HF's files
    template: Callable[[Path], ChatTemplate | None] | None = None
    turn_stops: Callable[[Path], list[str]] = _no_stops
    packs: tuple[str, ...] = ()
    exact: Callable[[Path], tuple[str, ...]] = _none_exact

    def chat_template(self, path: Path) -> ChatTemplate | None:
        """The checkpoint's chat template, or None when it has none. A template that does
        not compile, or files that do not parse, raise `ChatTemplateError`."""
        if self.template is not None:
            return self.template(path)
        source = _template_source(path)
        if source is None:
            return None
        stop = _json(path / GENERATION_CONFIG).get("stop_strings") or self.turn_stops(path)
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ChatTemplateError(f"{path / GENERATION_CONFIG}: stop_strings must be a string or a list of them")
        return ChatTemplate(source, tuple(stop))


def config_json(path: Path) -> dict:
    """A checkpoint directory's config.json, or {} where it has none (a file, say)."""
    return json_file(path / "config.json")


# -- chat templates, HF's files ------------------------------------------------------------------
def _template_source(path: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's "chat_template"."""
    if (path / TEMPLATE_FILE).is_file():
        return (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    found = _json(path / TOKENIZER_CONFIG).get("chat_template")
    if found is None or isinstance(found, str):
        return found
    # HF also stores several named templates: [{"name": "default", "template": "..."}, ...]
    listed = found if isinstance(found, list) else []
    named = {t.get("name"): t.get("template") for t in listed if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
        return named["default"]
    raise ChatTemplateError(f"{path / TOKENIZER_CONFIG}: chat_template is neither a string nor has a 'default'")


def _json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ChatTemplateError(f"{file}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{file}: not a JSON object")
    return data


def write_chat_template(directory: str | Path, template: ChatTemplate) -> None:
    """Store `template` in a checkpoint directory as `Reader.chat_template` reads it back."""
    out = Path(directory)
    (out / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    config = _json(out / GENERATION_CONFIG)
    config["stop_strings"] = list(template.stop)
    (out / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
