"""Finding and loading checkpoints: by shipped name or by directory, in either layout.

Three layouts: recur's native one (`model/native.py`: config.json names the family), HF
Mamba / Mamba-2 (`model/hf_ssm.py`: config.json's model_type) and the original / HF
Transformer-XL one (`model/hf.py`: any other config.json without "family"). `load` tells
them apart by config.json and hands the directory to that layout's reader. Shipped
checkpoints live in `model/weights/<name>/` and load by name.

Either layout may hold a chat template, HF's way (`chat_template`): chat_template.jinja,
else tokenizer_config.json's "chat_template", with its turn stop in
generation_config.json's "stop_strings". It is data, rendered in Jinja's sandbox
(`model/chat_template.py`); a checkpoint without one serves no chat.

The imports run one way, native <- hf <- checkpoint; `build`, `families` and `save` are
native's, offered here as part of the checkpoint API. Nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from . import hf, hf_ssm, native
from .chat_template import ChatTemplate, ChatTemplateError
from .family import LanguageModel
from .native import build, families, save

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

# checkpoint layout -> the reader that builds its model (on CPU, fp32)
READERS: dict[str, Callable[[Path], LanguageModel]] = {"native": native.read, "hf": hf.read, "hf-ssm": hf_ssm.read}


def shipped() -> list[str]:
    return sorted(p.name for p in WEIGHTS_DIR.iterdir() if (p / "config.json").is_file()) if WEIGHTS_DIR.is_dir() else []


def resolve(name_or_dir: str | Path) -> Path:
    path = Path(name_or_dir)
    if (path / "config.json").is_file():
        return path
    if (WEIGHTS_DIR / str(name_or_dir) / "config.json").is_file():
        return WEIGHTS_DIR / str(name_or_dir)
    raise FileNotFoundError(
        f"no checkpoint at {str(name_or_dir)!r}: not a directory with config.json, "
        f"and not a shipped model ({', '.join(shipped()) or 'none shipped'})"
    )


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def layout(path: Path) -> str:
    """"native" where config.json names a model family, "hf-ssm" for HF Mamba / Mamba-2
    (issue 29), else "hf" (Transformer-XL, issue 9)."""
    if "family" in json.loads((path / "config.json").read_text()):
        return "native"
    return "hf-ssm" if hf_ssm.claims(path) else "hf"


def load(name_or_dir: str | Path, device: str | torch.device = "auto", precision: str = "auto") -> LanguageModel:
    """Load a checkpoint by shipped name or directory, in eval mode on `device`.

    precision: "fp32", "bf16" (autocast, on CUDA or CPU) or "auto" (bf16 on CUDA, else fp32).
    """
    path = resolve(name_or_dir)
    lm = READERS[layout(path)](path)
    dev = resolve_device(device)
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32, bf16 or auto, not {precision!r}")
    lm.precision = precision
    return lm.to(dev).eval()


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
    source = _template_source(path)
    if source is None:
        return None
    stop = _json(path / GENERATION_CONFIG).get("stop_strings") or []
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
