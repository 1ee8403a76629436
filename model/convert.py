"""`recur convert SRC DST`: any checkpoint a reader reads, written as a native checkpoint.

The reader is the first in the registry (`model.checkpoint.READERS`) that claims SRC; its
`flags` are the options SRC may take (a Transformer-XL directory its serving settings, a
HF state-space or hybrid one its serving chunk), and the command's options are every
reader's. What a reader refuses, and why, is one line on stderr and exit status 2, never a
traceback. The chat template and the recommended generation settings travel with the
weights. Nothing here knows a layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import generation_config
from .checkpoint import READERS, layout, resolve
from .family import LanguageModel
from .native import save
from .reader import Flag, write_chat_template


def convert(src: str | Path, dst: str | Path, **flags: Any) -> LanguageModel:
    """Write the checkpoint at `src` (any layout `model.load` reads) as a native checkpoint
    at `dst`, with its chat template and recommended settings. `flags` are the reader's
    (None: not given); one the reader does not take raises ValueError, and nothing is
    written."""
    path = resolve(src)
    reader = layout(path)
    given = {name: value for name, value in flags.items() if value is not None}
    foreign = sorted(set(given) - {flag.name for flag in reader.flags})
    if foreign:
        takes = ", ".join(_option(f.name) for f in reader.flags) or "none"
        raise ValueError(
            f"{src} is {reader.describes}, which takes no {', '.join(map(_option, foreign))} (its options: {takes})"
        )
    lm = reader.read(path, **given)
    template = reader.chat_template(path)
    recommended = generation_config.read(path, str(src))
    save(lm, dst)
    if template is not None:
        write_chat_template(dst, template)
    if recommended.recommended():
        generation_config.write(dst, recommended)
    return lm


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flags() -> dict[str, tuple[Flag, list[str]]]:
    """Every reader's flags by name, with the layouts that take each."""
    out: dict[str, tuple[Flag, list[str]]] = {}
    for reader in READERS:
        for flag in reader.flags:
            known, takers = out.setdefault(flag.name, (flag, []))
            assert known.type is flag.type, f"readers disagree on {_option(flag.name)}'s type"
            takers.append(reader.name)
    return out


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint (GGUF, HF LLaMA / Mistral, Mamba, hybrids, Transformer-XL) to the native format",
        description="SRC is "
        + "; or ".join(reader.describes for reader in READERS)
        + ". The first of these that SRC is reads it (config.json's model_type tells the HF ones apart).",
    )
    p.add_argument("src")
    p.add_argument("dst")
    for name, (flag, takers) in _flags().items():
        kind: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction} if flag.type is bool else {"type": flag.type}
        )
        p.add_argument(_option(name), dest=name, default=None, help=f"{flag.help} ({', '.join(takers)})", **kind)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name) for name in _flags()}
    try:
        lm = convert(args.src, args.dst, **flags)
    except (ValueError, FileNotFoundError) as exc:  # what the readers refuse, and why: no traceback
        print(f"recur convert: {exc}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in lm.parameters())
    print(json.dumps({"dir": args.dst, "family": lm.family, "params": n, "fingerprint": lm.fingerprint}))
    return 0
