"""Held-out bits per byte, with the model's recurrent memory and without it.

Both figures score exactly the same predictions: every token of every work after its
BOS, given what precedes it in that work. They differ only in what that context is:

* with memory: the whole work is streamed through the recurrent state
  (`LanguageModel.consume`, in `segment_len` chunks), so a token sees the memory;
* memory off: the work is cut into segments of `segment_len` and each segment is run
  from a fresh state, like a vanilla Transformer over fixed segments (the paper's
  baseline). Resetting the state is the family-independent way to switch memory off;
  for Transformer-XL it is what `mem_len = 0` means at the segment level.

Bits are summed over every predicted token (the EOS included) and divided by the UTF-8
byte count of the works' text. Everything runs under `torch.no_grad()` in eval mode, so
the result is deterministic. Nothing here knows about HTTP or Redis.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .corpus import Work, encode_work
from .family import LanguageModel
from .tokenizer import Tokenizer


@dataclass
class Score:
    bits: float
    bytes: int
    tokens: int

    @property
    def bpb(self) -> float:
        return self.bits / max(self.bytes, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "bpb": self.bpb}


def _tokenizer(lm: LanguageModel) -> Tokenizer:
    if lm.tokenizer is None:
        raise ValueError("the model has no tokenizer")
    return lm.tokenizer


def _padded(seqs: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (N, Lmax) ids and a (N, Lmax) bool mask of real tokens."""
    n, longest = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((n, longest), pad, dtype=torch.long)
    real = torch.zeros(n, longest, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        real[i, : len(s)] = True
    return ids, real


@torch.no_grad()
def score_with_memory(lm: LanguageModel, works: list[Work], batch_size: int = 8) -> Score:
    """Stream each work through the recurrent state; works run side by side as streams.

    Right padding is harmless: a causal model never lets a padded position influence an
    earlier one, and padded positions are not scored.
    """
    was_training = lm.training
    lm.eval()
    bits, tokens = 0.0, 0
    encoded = [encode_work(text, _tokenizer(lm)) for _, text in works]
    try:
        for i in range(0, len(encoded), batch_size):
            ids, real = _padded(encoded[i : i + batch_size])
            ids, real = ids.to(lm.device), real.to(lm.device)
            lp, _ = lm.consume(ids, lm.new_state(ids.shape[0]))
            scored = real.clone()
            scored[:, 0] = False  # the first token (BOS) has no context to be predicted from
            bits -= float(lp[scored].double().sum()) / math.log(2)
            tokens += int(scored.sum())
    finally:
        lm.train(was_training)
    return Score(bits, sum(len(text.encode("utf-8")) for _, text in works), tokens)


@torch.no_grad()
def score_without_memory(lm: LanguageModel, works: list[Work], batch_size: int = 64) -> Score:
    """Each `segment_len` segment of each work alone, from a fresh state."""
    was_training = lm.training
    lm.eval()
    T = lm.segment_len
    inputs: list[list[int]] = []
    targets: list[list[int]] = []
    for _, text in works:
        ids = encode_work(text, _tokenizer(lm))
        for s in range(0, len(ids) - 1, T):
            inputs.append(ids[s : s + T])
            targets.append(ids[s + 1 : s + T + 1])
    bits, tokens = 0.0, 0
    try:
        for i in range(0, len(inputs), batch_size):
            x, _ = _padded(inputs[i : i + batch_size])
            y, real = _padded(targets[i : i + batch_size])
            x, y, real = x.to(lm.device), y.to(lm.device), real.to(lm.device)
            logits, _ = lm(x, lm.new_state(x.shape[0]))
            lp = F.log_softmax(logits.float(), -1)[:, : y.shape[1]].gather(2, y[..., None])[..., 0]
            bits -= float(lp[real].double().sum()) / math.log(2)
            tokens += int(real.sum())
    finally:
        lm.train(was_training)
    return Score(bits, sum(len(text.encode("utf-8")) for _, text in works), tokens)


def evaluate(lm: LanguageModel, works: list[Work]) -> dict:
    """Both figures for `works`, as a JSON-ready dict."""
    with_mem = score_with_memory(lm, works)
    without = score_without_memory(lm, works)
    return {
        "works": [name for name, _ in works],
        "bytes": with_mem.bytes,
        "tokens_scored": with_mem.tokens,
        "segment_len": lm.segment_len,
        "bpb_memory": round(with_mem.bpb, 6),
        "bpb_no_memory": round(without.bpb, 6),
    }


# -- CLI wiring (called from model/cli.py's register) -------------------------------------------
def resolve_text(spec: str) -> list[Work]:
    """`shakespeare-test` / `shakespeare-valid` name a held-out split; else a file or folder."""
    from . import corpus

    for split in ("test", "valid"):
        if spec == f"shakespeare-{split}":
            return corpus.load_split("shakespeare", split)
    return corpus.read_works(spec)


def add_subcommand(sub) -> None:  # sub: argparse._SubParsersAction
    p = sub.add_parser(
        "eval",
        help="bits per byte on a text, with the recurrent memory and with it off",
        description="Prints JSON with bpb_memory and bpb_no_memory for MODEL on --text.",
    )
    p.add_argument("model", help="shipped model name or checkpoint directory")
    p.add_argument(
        "--text",
        default="shakespeare-test",
        help="a .txt file, a folder of them, or shakespeare-test / shakespeare-valid",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"))
    p.set_defaults(func=_main)


def _main(args) -> int:
    import json

    from . import checkpoint

    try:
        lm = checkpoint.load(args.model, device=args.device, precision=args.precision)
        works = resolve_text(args.text)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"recur eval: {exc}") from None
    result = {"model": args.model, "fingerprint": lm.fingerprint, **evaluate(lm, works)}
    print(json.dumps(result))
    return 0
