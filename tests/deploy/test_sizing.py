"""The state-size formulas and measured rows of docs/DEPLOY.md's sizing table, checked
against real states: build a model, run it past its memory, and count `to_bytes()`."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import pytest
import torch

from model import checkpoint

DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"
WIDTH = {"float32": 4, "bfloat16": 2}
HEADER_MAX = 1536  # safetensors header + recur's JSON metadata; the docs say 0.5-1 KiB


def txl_bytes(cfg: dict, w: int) -> int:
    """docs/DEPLOY.md: (n_layer × mem_len × d_model + d_model) × w + 8, before the header."""
    return (cfg["n_layer"] * cfg["mem_len"] * cfg["d_model"] + cfg["d_model"]) * w + 8


def rlt_bytes(cfg: dict, w: int) -> int:
    """docs/DEPLOY.md: (d + 2(L_E + G)(C − 1)d + 2 L_D (W − 1)d) × w + 8, before the header."""
    d, c = cfg["d_model"], cfg["max_context"] - 1
    floats = d + 2 * (cfg["n_encoder_layers"] + cfg["memory_groups"]) * c * d
    floats += 2 * cfg["n_decoder_layers"] * (cfg["window"] - 1) * d
    return floats * w + 8


def ssm_bytes(cfg: dict, w: int) -> int:
    """docs/DEPLOY.md: (n_layer·((d_conv − 1)·conv_dim + D·d_state) + d_model) × w + 8."""
    D, N = cfg["expand"] * cfg["d_model"], cfg["d_state"]
    conv_dim = D + 2 * cfg["n_groups"] * N if "n_groups" in cfg else D
    return (cfg["n_layer"] * ((cfg["d_conv"] - 1) * conv_dim + D * N) + cfg["d_model"]) * w + 8


def hybrid_bytes(cfg: dict, w: int) -> int:
    """docs/HYBRIDS.md: (Lr·((d_conv − 1)·C + S) + 2·La·(M + Ms)·kvh·hd + d_model) × w + 8, the
    attention at its bound (exact: M = max_context, Ms = 0; bounded: M = window, Ms = sinks)."""
    Lr, La = cfg["pattern"].count("r"), cfg["pattern"].count("a")
    if "n_k_heads" in cfg:  # Gated DeltaNet
        C = 2 * cfg["n_k_heads"] * cfg["k_head_dim"] + cfg["n_v_heads"] * cfg["v_head_dim"]
        S = cfg["n_v_heads"] * cfg["k_head_dim"] * cfg["v_head_dim"]
    else:  # Mamba-2
        D = cfg["expand"] * cfg["d_model"]
        C, S = D + 2 * cfg["n_groups"] * cfg["d_state"], D * cfg["d_state"]
    rows = cfg["max_context"] if cfg["attention"] == "exact" else cfg["sinks"] + cfg["window"]
    floats = Lr * ((cfg["d_conv"] - 1) * C + S) + 2 * La * rows * cfg["n_kv_head"] * cfg["head_dim"]
    return (floats + cfg["d_model"]) * w + 8


FORMULA = {
    "transformer-xl": txl_bytes,
    "rlt": rlt_bytes,
    "mamba": ssm_bytes,
    "mamba2": ssm_bytes,
    "gdn-hybrid": hybrid_bytes,
    "mamba2-hybrid": hybrid_bytes,
}

# table rows checked here: label prefix -> (family, the row's config overrides, and the
# overrides of a smaller model of the same family to measure the formula on, or None to
# measure the row's own model). RLT consumes tokens one at a time, so its default model
# (512 positions of context) would take a while to fill; its formula is measured small.
SMALL = {
    "transformer-xl": {"n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64, "mem_len": 12},
    "rlt": {"max_context": 8, "window": 4, "memory_groups": 2, "d_model": 32, "n_head": 2, "d_ff": 64},
    "mamba": {"n_layer": 2, "d_model": 24, "d_state": 6, "d_conv": 3},
    "mamba2": {"n_layer": 2, "d_model": 32, "d_state": 8, "head_dim": 16, "n_groups": 2},
    "gdn-hybrid": {
        "pattern": "rar",
        "d_model": 24,
        "attention": "bounded",
        "sinks": 2,
        "window": 6,
        "max_context": 8,
    },
    "mamba2-hybrid": {
        "pattern": "rra",
        "d_model": 24,
        "ssm_head_dim": 8,
        "attention": "bounded",
        "sinks": 2,
        "window": 6,
        "max_context": 8,
    },
}
MAMBA_130M = {"n_layer": 24, "d_model": 768, "d_state": 16, "vocab_size": 50280}
MAMBA2_130M = {"n_layer": 24, "d_model": 768, "d_state": 128, "head_dim": 64, "vocab_size": 50288}
CHECKED_ROWS: dict[str, tuple[str, dict, dict | None]] = {
    "| Transformer-XL, `recur init` defaults": ("transformer-xl", {}, None),
    "| RLT, `recur init --family rlt` defaults": ("rlt", {}, SMALL["rlt"]),
    "| Mamba, `recur init --family mamba` defaults": ("mamba", {}, None),
    "| Mamba-2, `recur init --family mamba2` defaults": ("mamba2", {}, None),
    "| Mamba-130M": ("mamba", MAMBA_130M, SMALL["mamba"]),
    "| Mamba-2 130M": ("mamba2", MAMBA2_130M, SMALL["mamba2"]),
}
# a row for a shipped native model ("| Shipped `NAME`") is checked against its config.json
# (a packaged GGUF has none: the assistant's state sizes are docs/MODEL_CARD.md's, from
# State.to_bytes)
for _name in checkpoint.shipped():
    if not (_config := checkpoint.resolve(_name) / "config.json").is_file():
        continue
    _meta = json.loads(_config.read_text())
    CHECKED_ROWS[f"| Shipped `{_name}`"] = (_meta["family"], _meta["config"], SMALL.get(_meta["family"]))


def config(family: str, overrides: dict) -> dict:
    """The family's full config (no model built: a 130M-parameter one takes a while)."""
    return dataclasses.asdict(checkpoint.families()[family].config_class(**overrides))


def full_state_bytes(family: str, overrides: dict) -> tuple[dict, dict[str, int]]:
    """(the model's config, bytes of a state that has seen more tokens than it keeps, by dtype)."""
    return _full_state_bytes(family, json.dumps(overrides, sort_keys=True))


@functools.cache  # rows that share a measurement model run it once
def _full_state_bytes(family: str, overrides_json: str) -> tuple[dict, dict[str, int]]:
    torch.manual_seed(0)
    lm = checkpoint.build(family, json.loads(overrides_json)).eval()
    cfg = lm.config_dict()
    span = max(cfg.get("mem_len", 0), cfg.get("max_context", 0), cfg.get("window", 0))
    with torch.no_grad():
        _, state = lm.forward(torch.randint(0, 256, (1, span + 3)), lm.new_state())
    return cfg, {dtype: len(state.to_bytes(dtype=dtype)) for dtype in WIDTH}


HEADER_SLACK = 64  # a header's size varies by a few bytes with the digits of the tensor shapes


def doc_range(cell: str) -> tuple[float, float]:
    """The byte range a table cell such as "802 KB" or "1.60 MB" stands for, after rounding."""
    m = re.fullmatch(r"(\d+(?:\.(\d+))?) (KB|MB)", cell)
    assert m, f"not a size: {cell!r}"
    step = {"KB": 1e3, "MB": 1e6}[m[3]] / 10 ** len(m[2] or "")
    value = float(m[1]) * {"KB": 1e3, "MB": 1e6}[m[3]]
    return value - step / 2, value + step / 2


@pytest.mark.parametrize("label", list(CHECKED_ROWS), ids=lambda s: s.strip("| `"))
def test_formula_and_table_row_match_a_real_state(label: str) -> None:
    family, overrides, small = CHECKED_ROWS[label]
    if family not in checkpoint.families():
        pytest.skip(f"model family {family!r} is not in this tree")
    cfg, measured = full_state_bytes(family, overrides if small is None else small)
    headers = {}
    for dtype, w in WIDTH.items():
        headers[dtype] = measured[dtype] - FORMULA[family](cfg, w)
        assert 0 < headers[dtype] <= HEADER_MAX, f"{family} {dtype}: formula is off by {headers[dtype]} bytes"
    slack = 0
    if small is not None:  # the row's model: the checked formula plus the measured header
        cfg = config(family, overrides)
        measured = {dtype: FORMULA[family](cfg, w) + headers[dtype] for dtype, w in WIDTH.items()}
        slack = HEADER_SLACK

    rows = [line for line in DEPLOY_MD.read_text().splitlines() if line.startswith(label)]
    if not rows and label.startswith("| Shipped"):
        pytest.skip(f"docs/DEPLOY.md has no sizing row for {label[2:]} yet")
    assert len(rows) == 1, f"docs/DEPLOY.md has {len(rows)} sizing rows starting {label!r}"
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    for cell, dtype in zip(cells[2:4], WIDTH, strict=True):
        low, high = doc_range(cell)
        assert low - slack <= measured[dtype] < high + slack, (
            f"{dtype}: {measured[dtype]} bytes, not {cell}: {rows[0]}"
        )


def test_doc_formula_text_matches_the_checked_formulas() -> None:
    text = DEPLOY_MD.read_text()
    assert re.search(r"bytes = \(n_layer × mem_len × d_model \+ d_model\) × w \+ 8 \+ header", text)
    assert "2·(n_encoder_layers + memory_groups)·(max_context − 1)·d" in text
    assert "2·n_decoder_layers·(window − 1)·d" in text
    assert "n_layer·((d_conv − 1)·conv_dim + D·d_state) + d_model" in text
