"""What a GGUF file's metadata says, parsed once per version of the file: its scalars
(numbers and strings: the architecture, the sampling recommendation) and its chat template
with its stop tokens' texts.

Parsing a GGUF file's metadata takes seconds (SmolLM2's 49,152 tokens and their merges are
arrays of strings), and a server's start reads it three times: for the model
(`model.llama_gguf`), its sampling recommendation (`model.generation_config`) and its chat
template. The reader that parses a file keeps what those need here, by the file's version
(path, modification time, size); the parsed arrays are not kept (they hold some 200 MB).
This module imports no family, so every reader of GGUF metadata may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEPT = 8  # file versions whose metadata is kept


@dataclass(frozen=True)
class Metadata:
    scalars: dict[str, Any]  # every field that is not an array, by key
    template: tuple[str, tuple[str, ...]] | None  # the chat template's source, its stops' texts


def _version(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_mtime_ns, st.st_size


_kept: dict[tuple[str, int, int], Metadata] = {}


def _template(fields: dict[str, Any], scalars: dict[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """The chat template's source and the texts of the EOS, end-of-turn and end-of-message
    tokens (those the file names), or None when it has no template."""
    source = scalars.get("tokenizer.chat_template")
    if source is None:
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return source, ()
    ids = [scalars.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    n = len(tokens.data)
    return source, tuple(dict.fromkeys(tokens.contents(i) for i in ids if i is not None and 0 <= i < n))


def of_reader(path: Path, reader: Any) -> Metadata:
    """What `reader` (a `gguf.GGUFReader` of `path`) parsed, kept by the file's version."""
    from gguf import GGUFValueType

    fields = reader.fields
    scalars = {k: f.contents() for k, f in fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}
    found = _kept[_version(path)] = Metadata(scalars, _template(fields, scalars))
    while len(_kept) > KEPT:
        _kept.pop(next(iter(_kept)))
    return found


def metadata(path: Path) -> Metadata:
    """The GGUF file's metadata: as a reader of this version of it kept it, else parsed now."""
    found = _kept.get(_version(path))
    if found is None:
        from gguf import GGUFReader

        found = of_reader(path, GGUFReader(str(path)))
    return found
