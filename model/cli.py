"""The model-side `recur` subcommands: init, train, eval and convert (`recur replay`, which
may fetch a server's transcript, is registered by `app/replay_client.py`).

`app/cli.py` owns the top-level parser and calls `register()`; each subcommand's work
lives in the module named for it, so this file only wires flags to functions.
"""

from __future__ import annotations

import argparse
import json

from . import checkpoint, evaluate, hf, hf_ssm, train

# flag -> config field, for every family; a family takes the fields its config has
INIT_FLAGS: dict[str, type] = {
    "n_layer": int,
    "d_model": int,
    "n_head": int,
    "d_head": int,
    "d_inner": int,
    "mem_len": int,
    "tgt_len": int,
    "n_encoder_layers": int,
    "n_decoder_layers": int,
    "window": int,
    "memory_groups": int,
    "max_context": int,
    "d_state": int,  # Mamba, Mamba-2
    "d_conv": int,
    "expand": int,
    "dt_rank": int,  # Mamba
    "head_dim": int,  # Mamba-2
    "n_groups": int,
    "chunk_size": int,
    "pattern": str,  # the hybrids' layers: r recurrent, a attention
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write a random-weight checkpoint (for tests and benchmarks)")
    p.add_argument("dir")
    p.add_argument("--family", default="transformer-xl")
    p.add_argument("--seed", type=int, default=0)
    for name, typ in INIT_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None)
    p.set_defaults(func=_init)
    train.add_subcommand(sub)
    evaluate.add_subcommand(sub)
    hf.add_subcommand(  # recur convert (issues 9, 28, 29)
        sub, [(hf_ssm.claims, hf_ssm.convert, ("tgt_len",)), (checkpoint.converts, checkpoint.convert, ())]
    )


def _init(args: argparse.Namespace) -> int:
    import dataclasses

    cls = checkpoint.families()[args.family]
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    given = {k: getattr(args, k) for k in INIT_FLAGS if getattr(args, k) is not None}
    bad = sorted(set(given) - fields)
    if bad:
        raise SystemExit(
            f"recur init: --family {args.family} has no option(s) {', '.join('--' + b.replace('_', '-') for b in bad)}"
        )
    lm = checkpoint.init(args.dir, family=args.family, seed=args.seed, **given)
    n = sum(p.numel() for p in lm.parameters())
    print(json.dumps({"dir": args.dir, "family": lm.family, "params": n, "fingerprint": lm.fingerprint}))
    return 0
