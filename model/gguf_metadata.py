"""A GGUF file's scalar metadata (numbers and strings: its architecture, its sampling
recommendation), parsed once per version of the file.

Parsing a GGUF file's metadata takes seconds (SmolLM2's 49,152 tokens and their merges are
arrays of strings), and one load reads the file for the model (`model.llama_gguf`) and again
for its sampling recommendation (`model.generation_config`). The reader that parses a file
keeps its scalars here; the parsed arrays are not kept (they hold some 200 MB). This module
imports no family, so every reader of GGUF metadata may import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SCALARS_KEPT = 8  # file versions whose scalar metadata `scalars` keeps


def _version(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_mtime_ns, st.st_size


_scalars: dict[tuple[str, int, int], dict[str, Any]] = {}


def keep_scalars(path: Path, reader: Any) -> dict[str, Any]:
    """Keep the scalars of the file `reader` (a `gguf.GGUFReader`) parsed, by its version."""
    from gguf import GGUFValueType

    found = {
        key: field.contents()
        for key, field in reader.fields.items()
        if field.types and field.types[0] != GGUFValueType.ARRAY
    }
    _scalars[_version(path)] = found
    while len(_scalars) > SCALARS_KEPT:
        _scalars.pop(next(iter(_scalars)))
    return found


def scalars(path: Path) -> dict[str, Any]:
    """The GGUF file's scalar metadata (numbers, strings; no arrays) by key. Parsing a file's
    metadata takes seconds (SmolLM2's 49,152 tokens and their merges, arrays), and one load
    reads the file for the model and again for its sampling recommendation
    (`model.generation_config`): the scalars of the versions (path, modification time, size)
    a `GGUF` opened are kept, the parsed arrays are not (they hold some 200 MB)."""
    found = _scalars.get(_version(path))
    if found is None:
        from gguf import GGUFReader

        found = keep_scalars(path, GGUFReader(str(path)))
    return found
