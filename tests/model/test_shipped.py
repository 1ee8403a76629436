"""The shipped Shakespeare checkpoints: load by name, are what we shipped, and still write.

If these pins change, a checkpoint in model/weights/ changed: update docs/MODEL_CARD.md
with it.
"""

from __future__ import annotations

import torch

import model
from model import checkpoint, corpus, evaluate

FINGERPRINT = "e3da372c148c7856"
MAMBA_FINGERPRINT = "d6831d7ce135d542"  # shakespeare-mamba, a Mamba-2
GREEDY_AFTER_ROMEO = "\n\n\n\nSCENE II. A Room in the Palace.\n\n[Enter CLOWN,"
MAX_BYTES = 25 * 1024 * 1024


def greedy(lm: model.LanguageModel, prompt: str, n: int) -> str:
    tok = lm.tokenizer
    assert tok is not None and tok.bos_id is not None
    _, st = lm(torch.tensor([[tok.bos_id, *tok.encode(prompt)]]), lm.new_state(1))
    ids = []
    for _ in range(n):
        nid = int(lm.next_logits(st).argmax(-1)[0])
        ids.append(nid)
        _, st = lm(torch.tensor([[nid]]), st)
    return tok.decode(ids)


def assert_shipped_files(name: str) -> None:
    """The checkpoint is the weights and tokenizer, and the chat template with its turn stop
    (HF's files), and small."""
    files = {p.name: p.stat().st_size for p in (checkpoint.WEIGHTS_DIR / name).iterdir()}
    assert set(files) == {
        "config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"
    }  # fmt: skip
    assert sum(files.values()) <= MAX_BYTES


def assert_knows_shakespeare(lm: model.LanguageModel) -> None:
    """A guard on quality, not a pin: 8 kB from the middle of a held-out play, and the memory
    helps."""
    name, text = corpus.load_split("shakespeare", "test")[0]
    excerpt = [(name, text[40_000:48_000])]
    with_memory = evaluate.score_with_memory(lm, excerpt).bpb
    assert with_memory < 2.5, (name, with_memory)  # uniform over bytes would be 8
    assert with_memory < evaluate.score_without_memory(lm, excerpt).bpb


def test_shipped_checkpoint_is_small_safetensors_and_loads_by_name():
    assert "shakespeare" in model.shipped()
    assert_shipped_files("shakespeare")
    lm = model.load("shakespeare", device="cpu")
    assert lm.family == "transformer-xl" and not lm.training
    assert lm.tokenizer is not None and lm.tokenizer.vocab_size == 258


def test_shipped_fingerprint_is_stable():
    assert model.load("shakespeare", device="cpu").fingerprint == FINGERPRINT
    assert model.load(checkpoint.WEIGHTS_DIR / "shakespeare", device="cpu").fingerprint == FINGERPRINT


def test_greedy_generation_after_romeo_is_deterministic():
    lm = model.load("shakespeare", device="cpu")
    first = greedy(lm, "ROMEO:", 50)
    assert greedy(model.load("shakespeare", device="cpu"), "ROMEO:", 50) == first
    assert first == GREEDY_AFTER_ROMEO


def test_shipped_model_predicts_held_out_text_and_uses_its_memory():
    assert_knows_shakespeare(model.load("shakespeare", device="cpu"))


def test_the_shipped_mamba_is_what_we_shipped_and_knows_shakespeare():
    """`shakespeare-mamba`: the pin, its files, and the same quality guard as above."""
    assert_shipped_files("shakespeare-mamba")
    lm = model.load("shakespeare-mamba", device="cpu")
    assert lm.family == "mamba2" and lm.fingerprint == MAMBA_FINGERPRINT and not lm.training
    assert checkpoint.chat_template("shakespeare-mamba") is not None
    assert_knows_shakespeare(lm)


def test_the_context_window_is_each_familys_attention_span():
    txl, rlt = model.load("shakespeare", device="cpu"), model.load("shakespeare-rlt", device="cpu")
    assert txl.context_window == txl.config.mem_len + 1
    assert rlt.context_window == rlt.config.max_context
    ssm = model.load("shakespeare-mamba", device="cpu")
    assert ssm.context_window is None  # no attention: the whole stream is in the SSM state
