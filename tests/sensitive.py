"""Tiny models whose state matters, for every test that needs a model to feel its context.

`model.init`'s GPT-2 initialisation (weights N(0, 0.02)) makes a tiny model's log-probs
nearly uniform: zeroing a tiny Mamba's SSM state moved no log-prob by more than 5e-7, so a
server that dropped a session's state on every request passed every test that served it
(issue 38). `sensitize` gives a model's weights unit gain (each layer's output as large as
its input), spreads an SSM's decay rates so that some channels forget within a few tokens
and some keep the whole stream, and makes Transformer-XL's position and content biases
matter. tests/app/test_served_models.py holds every served model to the bar: zeroing any
one part of its state moves some log-prob by at least `MATTERS`.
"""

from __future__ import annotations

from pathlib import Path

import torch

import model
from model.chat_template import ChatTemplate

MATTERS = 1e-2  # the least change in some log-prob that zeroing a part of the state must make


@torch.no_grad()
def sensitize(lm: model.LanguageModel, seed: int = 0) -> model.LanguageModel:
    """`lm` with weights of unit gain (in place; its fingerprint updated), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    for name, p in lm.named_parameters():
        if name.endswith("A_log"):  # SSM decay rates from fast to nearly none
            p.copy_(torch.empty_like(p).uniform_(-3.0, 1.0, generator=g))
        elif name.endswith(("dt_proj.bias", "dt_bias")):
            p.copy_(torch.empty_like(p).uniform_(-4.0, 1.0, generator=g))
        elif name.endswith(("r_w_bias", "r_r_bias")):  # Transformer-XL's global biases
            p.copy_(torch.empty_like(p).normal_(0.0, 0.5, generator=g))
        elif p.dim() >= 2:  # embeddings of unit size, every other matrix of unit gain
            std = 1.0 if "embed" in name else p[0].numel() ** -0.5
            p.copy_(torch.empty_like(p).normal_(0.0, std, generator=g))
    lm.fingerprint = model.fingerprint(lm)
    return lm.eval()


def sensitive_model(family: str, config: dict, seed: int = 0) -> model.LanguageModel:
    """A tiny model of `family` built from `config`, its state made to matter."""
    torch.manual_seed(seed)
    return sensitize(model.build(family, config), seed)


def write_sensitive(
    directory: str | Path,
    family: str = "transformer-xl",
    seed: int = 0,
    chat_template: ChatTemplate | None = None,
    **config: object,
) -> model.LanguageModel:
    """`model.init`, with the state made to matter: the checkpoint a test serves."""
    model.init(directory, family=family, seed=seed, chat_template=chat_template, **config)
    lm = sensitize(model.load(directory), seed)
    model.save(lm, directory)
    return lm
