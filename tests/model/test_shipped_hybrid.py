"""The shipped hybrid, `shakespeare-hybrid`: what we shipped, its files, and still writes.

If the pin changes, model/weights/shakespeare-hybrid/ changed: update docs/MODEL_CARD.md with it.
"""

from __future__ import annotations

import torch

import model
from model import checkpoint

from .test_shipped import assert_knows_shakespeare, assert_shipped_files

HYBRID_FINGERPRINT = "c058de173772c971"


def test_the_shipped_hybrid_is_what_we_shipped_and_knows_shakespeare():
    assert_shipped_files("shakespeare-hybrid")
    lm = model.load("shakespeare-hybrid", device="cpu")
    assert lm.family == "gdn-hybrid" and lm.fingerprint == HYBRID_FINGERPRINT and not lm.training
    assert lm.config.pattern == "rrarra" and lm.config.attention == "bounded"
    assert checkpoint.chat_template("shakespeare-hybrid") is not None
    assert_knows_shakespeare(lm)


def test_the_shipped_hybrid_serves_exact_attention_as_an_option():
    """Within sinks + window + 1 tokens, exact attention (the option) gives the shipped
    bounded model's logits; past them the window slides and the two part."""
    bounded = model.load("shakespeare-hybrid", device="cpu")
    exact = model.load("shakespeare-hybrid", device="cpu", options="attention=exact,max_context=2048")
    span = bounded.config.sinks + bounded.config.window + 1
    tokens = torch.tensor([list(b"ROMEO.\nBut soft, what light through yonder window breaks? " * 8)])
    with torch.no_grad():
        a, _ = bounded(tokens)
        b, _ = exact(tokens)
    assert tokens.shape[1] > span
    torch.testing.assert_close(a[:, :span], b[:, :span], atol=1e-4, rtol=0)
