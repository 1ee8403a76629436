"""Pretrained Transformer-XL checkpoints in the original / HF `TransfoXLLMHeadModel` layout.

A source directory holds
    config.json                      the HF `TransfoXLConfig` (no "family" key)
    model.safetensors                or pytorch_model.bin (or their sharded *.index.json)
    vocab.txt                        the word vocabulary, one symbol per line in id order

`read(DIR)` turns it into a native `TransformerXL` (attention="segment", adaptive
embedding and softmax, the checkpoint's `same_length`, `clamp_len`, `untie_r`,
`pre_lnorm`); `recur convert SRC DST` (`model/convert.py`) writes it as a native checkpoint,
and `model.load(SRC)` reads the source directly. Parameter names mirror the original code, so
the conversion is a key rename ("transformer." prefix dropped) plus weight tying.

Safety: `.bin` files are read only with `torch.load(weights_only=True)`, which refuses
anything but tensors and plain containers, and the HF tokenizer's pickled vocabulary
(vocab.pkl / vocab.bin) is never read: export it to vocab.txt (docs/PRETRAINED.md).

This module builds on the native format (`model/native.py`) and must never import
`model/checkpoint.py`, whose registry lists this reader (`READER`) last: it takes any
directory with config.json that no other reader claims.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .hf_files import read_weights
from .native import build, fingerprint
from .reader import TGT_LEN, Flag, Reader
from .tokenizer import WordTokenizer
from .transformer_xl import TransformerXL

VOCAB_FILE = "vocab.txt"
# the published WikiText-103 evaluation segment length, for configs that do not say
DEFAULT_TGT_LEN = 128


def native_config(hf: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A HF `TransfoXLConfig` dict -> the native TransformerXLConfig fields."""
    model_type = hf.get("model_type", "transfo-xl")
    if model_type != "transfo-xl":
        raise ValueError(
            f"config.json describes a {model_type!r} model; only Transformer-XL (transfo-xl) converts"
        )
    if hf.get("attn_type", 0) != 0:
        raise ValueError(
            f"attn_type {hf['attn_type']} is not supported (only 0, relative attention, was published)"
        )
    if hf.get("sample_softmax", -1) > 0:
        raise ValueError("sample_softmax checkpoints are not supported")
    d_model = hf.get("d_model", 1024)
    cutoffs = list(hf.get("cutoffs", []))
    tie_projs = hf.get("tie_projs")
    if tie_projs is None:  # the config's constructor derives it this way
        tie_projs = [False] + [bool(hf.get("proj_share_all_but_first", True))] * len(cutoffs)
    cfg = {
        "vocab_size": hf.get("vocab_size", hf.get("n_token")),
        "n_layer": hf.get("n_layer", 18),
        "d_model": d_model,
        "n_head": hf.get("n_head", 16),
        "d_head": hf.get("d_head", 64),
        "d_inner": hf.get("d_inner", 4096),
        "mem_len": hf.get("mem_len", 1600),
        "tgt_len": hf.get("tgt_len", DEFAULT_TGT_LEN),
        "clamp_len": max(0, hf.get("clamp_len", 1000)),
        "pre_lnorm": bool(hf.get("pre_lnorm", False)),
        "dropout": hf.get("dropout", 0.1),
        "dropatt": hf.get("dropatt", 0.0),
        "attention": "segment",
        "untie_r": bool(hf.get("untie_r", True)),
        "tie_weights": bool(hf.get("tie_word_embeddings", hf.get("tie_weight", True))),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "adaptive": True,
        "d_embed": hf.get("d_embed", d_model),
        "cutoffs": cutoffs,
        "div_val": hf.get("div_val", 1),
        "tie_projs": [bool(t) for t in tie_projs],
        "same_length": bool(hf.get("same_length", False)),
    }
    if cfg["vocab_size"] is None:
        raise ValueError("config.json has no vocab_size")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


_SHARED_BIAS = re.compile(r"layers\.\d+\.dec_attn\.(r_w_bias|r_r_bias)$")


def native_state_dict(lm: TransformerXL, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename original / HF keys to `lm`'s and resolve tied weights the way HF's tie_weights does.

    Tied parameters (output layers and projections shared with the embedding, biases
    shared by all layers) are read from the embedding side / the global copy; copies of
    them in the source are ignored. Raises ValueError naming missing or unexpected keys.
    """
    src = {k.removeprefix("transformer."): v for k, v in source.items()}
    src.pop("pos_emb.inv_freq", None)  # a constant buffer, recomputed here
    if not lm.config.untie_r:
        for k in [k for k in src if _SHARED_BIAS.search(k)]:
            # per-layer aliases of the shared biases (HF registers them in every layer)
            src.setdefault(_SHARED_BIAS.search(k).group(1), src[k])  # type: ignore[union-attr]
            del src[k]

    target = lm.state_dict()
    owner: dict[int, str] = {}  # tensor storage -> its first (embedding-side) name
    aliases: dict[str, str] = {}
    for name, t in target.items():
        first = owner.setdefault(t.data_ptr(), name) if t.numel() else name
        if first != name:
            aliases[name] = first
    for name in aliases:
        src.pop(name, None)
    missing = sorted(set(target) - set(aliases) - set(src))
    unexpected = sorted(set(src) - set(target))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, t in target.items():
        s = src[aliases.get(name, name)]
        if s.shape != t.shape:
            raise ValueError(f"weight {name} has shape {list(s.shape)}, the config implies {list(t.shape)}")
    return {name: src[aliases.get(name, name)].to(torch.float32) for name in target}


def read(path: str | Path, vocab: str | Path | None = None, **overrides: Any) -> TransformerXL:
    """Build the native model for an original / HF directory (on CPU, fp32, eval mode).

    `vocab` defaults to DIR/vocab.txt; `overrides` replace native config fields
    (e.g. tgt_len, mem_len, clamp_len, same_length).
    """
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = native_config(hf, **overrides)
    vocab_path = Path(vocab) if vocab is not None else path / VOCAB_FILE
    if not vocab_path.is_file():
        raise FileNotFoundError(
            f"no word vocabulary at {vocab_path}: write it as plain text, one symbol per line in id "
            "order (the HF vocab.pkl is a pickle and is never read; see docs/PRETRAINED.md)"
        )
    tok = WordTokenizer.from_vocab_file(vocab_path)
    if tok.vocab_size != cfg["vocab_size"]:
        raise ValueError(
            f"{vocab_path} has {tok.vocab_size} symbols, the model's vocab_size is {cfg['vocab_size']}"
        )
    lm = build("transformer-xl", cfg, tok.spec())
    assert isinstance(lm, TransformerXL)
    lm.load_state_dict(native_state_dict(lm, read_weights(path, allow_bin=True)), strict=True)
    lm.fingerprint = fingerprint(lm)
    return lm.eval()


def claims(path: Path) -> bool:
    """Any directory with config.json: the registry's last resort, which refuses with a clear
    error a config that is not Transformer-XL's (`native_config`)."""
    return (path / "config.json").is_file()


READER = Reader(
    "hf",
    "an original / HF Transformer-XL directory (config.json, model.safetensors or pytorch_model.bin, vocab.txt)",
    claims,
    read,
    flags=(
        Flag("vocab", str, "plain-text vocabulary (default SRC/vocab.txt)"),
        TGT_LEN,
        Flag("mem_len", int, "how many past positions the state keeps"),
        Flag("clamp_len", int, "the furthest relative position attended as itself"),
        Flag("same_length", bool, "every position attends as many past positions"),
    ),
)
