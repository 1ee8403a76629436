"""The model-side `recur` subcommands: init, train, eval and convert (`recur replay`, which
may fetch a server's transcript, is registered by `app/replay_client.py`).

`app/cli.py` owns the top-level parser and calls `register()`; each subcommand's work
lives in the module named for it (`recur convert`: `model/convert.py`), so this file only
wires flags to functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from . import checkpoint, convert, evaluate, train

SCALARS = (int, float, str, bool)  # the config fields a command-line flag can set


def init_flags() -> dict[str, tuple[type, list[str]]]:
    """`recur init`'s config flags: every scalar field of every family's config, with its
    type and the families that have it (a list-valued field, such as Transformer-XL's
    cutoffs, keeps its default)."""
    out: dict[str, tuple[type, list[str]]] = {}
    for family, cls in checkpoint.families().items():
        hints = typing.get_type_hints(cls.config_class)
        for field in dataclasses.fields(cls.config_class):
            typ = hints[field.name]
            if typ in SCALARS:
                known, owners = out.setdefault(field.name, (typ, []))
                assert known is typ, f"families disagree on {field.name}'s type"
                owners.append(family)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write a random-weight checkpoint (for tests and benchmarks)")
    p.add_argument("dir")
    p.add_argument("--family", default="transformer-xl", choices=sorted(checkpoint.families()))
    p.add_argument("--seed", type=int, default=0)
    config = p.add_argument_group("config", "the family's config fields (default: the family's own)")
    every = len(checkpoint.families())
    for name, (typ, owners) in init_flags().items():
        kind: dict = {"action": argparse.BooleanOptionalAction} if typ is bool else {"type": typ}
        owned = "every family" if len(owners) == every else ", ".join(owners)
        config.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=owned, **kind)
    p.set_defaults(func=_init)
    train.add_subcommand(sub)
    evaluate.add_subcommand(sub)
    convert.add_subcommand(sub)


def _init(args: argparse.Namespace) -> int:
    cls = checkpoint.families()[args.family]
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    given = {k: getattr(args, k) for k in init_flags() if getattr(args, k) is not None}
    bad = sorted(set(given) - fields)
    if bad:
        raise SystemExit(
            f"recur init: --family {args.family} has no option(s) {', '.join('--' + b.replace('_', '-') for b in bad)}"
        )
    lm = checkpoint.init(args.dir, family=args.family, seed=args.seed, **given)
    n = sum(p.numel() for p in lm.parameters())
    print(json.dumps({"dir": args.dir, "family": lm.family, "params": n, "fingerprint": lm.fingerprint}))
    return 0
