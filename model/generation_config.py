"""A checkpoint's recommended generation settings: what a request gets for each sampling
control it leaves out.

A model is trained and tuned for some sampling. At the OpenAI clients' own defaults
(temperature 1, no top-p), SmolLM2-135M-Instruct answered "What is the capital of France?"
with 323 tokens of French-like gibberish. So the server asks the checkpoint, in this order:

1. a `generation_config.json` beside the weights (HF's file: `temperature`, `top_p`,
   `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`; `do_sample: false` means
   greedy), as HF directories and native checkpoints carry it;
2. a GGUF file's `general.sampling.*` metadata (llama.cpp's keys: `temp`, `top_p`, `top_k`,
   `min_p`, `penalty_repeat`);
3. the card of a packaged model whose file carries neither (`CARDS`).

A checkpoint with none of them recommends nothing, and each control keeps its neutral value
(temperature 1, top-p 1, no top-k, min-p or penalty). This module reads files only: it knows
nothing of requests; the server applies the settings (app/api/http/deps.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_metadata import metadata

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfig:
    """Recommended values; None: the control's neutral value. `max_tokens` bounds a reply
    whose request names no bound (the server's own cap bounds it too). `source` says where
    the values came from, for `/v1/models` and the logs."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "none"

    def recommended(self) -> dict[str, float | int]:
        """The controls this checkpoint sets, by the API's names."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "source" and (v := getattr(self, f.name)) is not None
        }


# packaged checkpoints whose files carry no recommendation: their model cards' settings
CARDS: dict[str, GenerationConfig] = {
    # measured on the shipped Q4_1 file (docs/MODEL_CARD.md "Sampling defaults",
    # bench/assistant_defaults.py): greedy answers the most of the study's questions right,
    # and the shortest; the SmolLM2 card's temperature 0.2, top-p 0.9 answers the capital of
    # France right in 6 seeds of 10 (its first token splits between "The" and "L'", 0.152 to
    # 0.140). 512 tokens hold an assistant's answer and take about 30 s on a 2-core CPU, where
    # the server's cap of 1,024 took 103 s.
    "smollm2": GenerationConfig(
        temperature=0.0, max_tokens=512, source="docs/MODEL_CARD.md's sampling study of the shipped file"
    ),
}

# llama.cpp's GGUF keys -> ours
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# HF's generation_config.json keys -> ours
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """A checkpoint's recommendation that cannot be a sampling setting (a negative
    temperature, a top-p past 1, ...): the checkpoint is refused when it loads."""


def read(path: Path, name: str = "") -> GenerationConfig:
    """The recommendation of the checkpoint at `path` (a directory, or a GGUF file), loaded
    as `name` (a packaged model's name finds its card)."""
    directory = path if path.is_dir() else None
    if directory is not None and (directory / FILE).is_file():
        found = _from_hf(directory / FILE)
        if found is not None:
            return found
    if path.is_file() and path.suffix == ".gguf":
        found = _from_gguf(path)
        if found is not None:
            return found
    return CARDS.get(name, GenerationConfig())


def write(directory: str | Path, config: GenerationConfig) -> None:
    """Put `config` into the directory's generation_config.json (HF's names), keeping the
    file's other keys (its stop strings, its EOS ids): what `recur convert` carries over."""
    path = Path(directory) / FILE
    out: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    theirs = {ours: hf for hf, ours in _HF_KEYS.items()}
    for name, value in config.recommended().items():
        out[theirs[name]] = value
    if config.temperature is not None:
        out["do_sample"] = config.temperature > 0
    path.write_text(json.dumps(out, indent=2) + "\n")


def _from_hf(file: Path) -> GenerationConfig | None:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{file}: not a JSON object ({exc})") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{file}: not a JSON object")
    values = {ours: raw[hf] for hf, ours in _HF_KEYS.items() if raw.get(hf) is not None}
    if raw.get("do_sample") is False:  # HF: greedy, whatever the temperature says
        values["temperature"] = 0.0
    return _checked(values, str(file))


def _from_gguf(file: Path) -> GenerationConfig | None:
    meta = metadata(file).scalars
    values = {ours: meta[key] for key, ours in _GGUF_KEYS.items() if meta.get(key) is not None}
    return _checked(values, f"{file}'s GGUF metadata")


_BOUNDS: dict[str, tuple[float, float]] = {  # (low, high), inclusive; as the API's fields
    "temperature": (0.0, 100.0),
    "top_p": (1e-9, 1.0),
    "top_k": (0, 1 << 20),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),
    "max_tokens": (1, 1 << 20),
}


def _checked(values: dict[str, Any], where: str) -> GenerationConfig | None:
    """The values as a GenerationConfig from `where`, None when they recommend nothing;
    GenerationConfigError for one that no sampler takes."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        low, high = _BOUNDS[name]
        integral = name in ("top_k", "max_tokens")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not low <= value <= high or (integral and value != int(value)):
            raise GenerationConfigError(f"{where}: {name} {value!r} is not a sampling setting")
        out[name] = int(value) if integral else float(value)
    if out.get("top_k") == 0:
        del out["top_k"]  # HF's "no top-k"
    return GenerationConfig(**out, source=where) if out else None
