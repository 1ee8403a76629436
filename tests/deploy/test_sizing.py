"""The state-size formulas and measured rows of docs/DEPLOY.md's sizing table, checked
against real states: build a model, run it past its memory, and count `to_bytes()`."""

from __future__ import annotations

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


FORMULA = {"transformer-xl": txl_bytes, "rlt": rlt_bytes}

# table rows checked here: label prefix -> (family, the row's config overrides, and the
# overrides of a smaller model of the same family to measure the formula on, or None to
# measure the row's own model). RLT consumes tokens one at a time, so its default model
# (512 positions of context) would take a while to fill; its formula is measured small.
SMALL = {
    "transformer-xl": {"n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64, "mem_len": 12},
    "rlt": {"max_context": 8, "window": 4, "memory_groups": 2, "d_model": 32, "n_head": 2, "d_ff": 64},
}
CHECKED_ROWS: dict[str, tuple[str, dict, dict | None]] = {
    "| Transformer-XL, `recur init` defaults": ("transformer-xl", {}, None),
    "| RLT, `recur init --family rlt` defaults": ("rlt", {}, SMALL["rlt"]),
}
# a row for a shipped model ("| Shipped `NAME`") is checked against its config.json (the
# packaged GGUF files, installed by `make install`, have none and no row)
for _name in filter(lambda n: checkpoint.resolve(n).is_dir(), checkpoint.shipped()):
    _meta = json.loads((checkpoint.resolve(_name) / "config.json").read_text())
    CHECKED_ROWS[f"| Shipped `{_name}`"] = (_meta["family"], _meta["config"], SMALL.get(_meta["family"]))


def config(family: str, overrides: dict) -> dict:
    return checkpoint.build(family, overrides).config_dict()


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
