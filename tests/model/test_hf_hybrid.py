"""Parity of the hybrids with transformers' own Qwen3.5, Qwen3-Next, Granite-4.0-H and Bamba
(their PyTorch paths, on CPU).

The reference runs once per module in a subprocess (tests/model/hf_hybrid_reference.py) with
the isolated current-transformers environment `.venv-ref-current/` on its path. It writes
random `Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`, `GraniteMoeHybridForCausalLM` and
`BambaForCausalLM` checkpoints of several layer patterns with `save_pretrained`, the logits of a 320-token
sequence in one call, and the logits of the same sequence fed through transformers' cache
(a prompt, chunks, then token by token). Here `recur convert` and `model.load` read those
directories, and recur's logits, fed whole and in random chunkings, must agree with both
within 1e-4 in fp32. The shapes are ones where the recurrent state matters: zeroing it moves
the logits by more than 1e-2 (checked too).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from app.cli import main as recur_cli
from model import hf_hybrid
from model.hybrid import ContextFull

from .reference_env import CURRENT

REF_SCRIPT = Path(__file__).with_name("hf_hybrid_reference.py")
TOL = 1e-4
LENGTH, PROMPT, CHUNK = 320, 100, 37
QWEN = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_key_head_dim=16, linear_value_head_dim=16, rms_norm_eps=1e-5,
)  # fmt: skip
GRANITE = dict(
    vocab_size=64, hidden_size=32, shared_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
    num_local_experts=0, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, rms_norm_eps=1e-5,
)  # fmt: skip
CASES = {
    # Qwen3.5's own layout, the default pattern (three DeltaNet layers, then attention);
    # two value heads per key head
    "qwen35-rrra": ("qwen3_5_text", "rrra", dict(QWEN, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4)),
    # attention first and last, one value head per key head, a tied head, attention biases
    "qwen35-arra-tied": ("qwen3_5_text", "arra", dict(
        QWEN, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, tie_word_embeddings=True,
        attention_bias=True, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    )),
    # Qwen3-Next: q, k, v, z and b, a grouped by key head, dense MLPs
    "qwen3next-rar": ("qwen3_next", "rar", dict(
        QWEN, num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )),
    # Granite-4.0-H's way: no positions, muP multipliers, two groups, SSD chunks of 7
    "granite-rrar-nope": ("granitemoehybrid", "rrar", dict(
        GRANITE, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_groups=2,
        mamba_chunk_size=7, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=2.0, position_embedding_type="nope",
    )),
    # RoPE, biases in the Mamba projections and the attention, a tied head
    "granite-ara-rope": ("granitemoehybrid", "ara", dict(
        GRANITE, num_hidden_layers=3, layer_types=["attention", "mamba", "attention"], mamba_chunk_size=64,
        position_embedding_type="rope", mamba_proj_bias=True, attention_bias=True, tie_word_embeddings=True,
    )),
    # Bamba: Granite's layers, RoPE on half of each head, attention placed by index
    "bamba-rar": ("bamba", "rar", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_chunk_size=5, rms_norm_eps=1e-5,
    )),
}  # fmt: skip

# transformers' Bamba fed through its cache disagrees with its own whole-sequence logits from
# the first chunk after the prompt on (by 0.72 here); recur matches the whole sequence's
CACHE_DISAGREES = {"bamba-rar"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf-hybrid")
    spec = [
        {"name": name, "kind": kind, "config": config, "batch": 2, "length": LENGTH, "prompt": PROMPT,
         "chunk": CHUNK, "seed": i}
        for i, (name, (kind, _, config)) in enumerate(CASES.items())
    ]  # fmt: skip
    (out / "cases.json").write_text(json.dumps(spec))
    CURRENT.run(REF_SCRIPT, out, out / "cases.json", home=out / "hf-home", timeout=600)
    return {name: out / name for name in CASES}


def chunked_logits(lm: model.LanguageModel, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The sequence fed in random chunks of 1 to 60 tokens, token by token at the end."""
    rng, out, state, t = random.Random(seed), [], lm.new_state(ids.shape[0]), 0
    with torch.no_grad():
        while t < ids.shape[1]:
            n = 1 if t >= ids.shape[1] - 12 else rng.randint(1, 60)
            logits, state = lm(ids[:, t : t + n], state)
            out.append(logits)
            t += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("case", CASES)
def test_converted_hybrids_match_transformers(reference, tmp_path, capsys, case):
    src = reference[case]
    assert recur_cli(["convert", str(src), str(tmp_path / "native")]) == 0
    printed = json.loads(capsys.readouterr().out)
    lm = model.load(tmp_path / "native", device="cpu")
    family = "gdn-hybrid" if CASES[case][0].startswith("qwen") else "mamba2-hybrid"
    assert lm.family == family == printed["family"] and lm.fingerprint == printed["fingerprint"]
    assert lm.config.pattern == CASES[case][1] and lm.config.attention == "exact"
    assert model.load(src, device="cpu").fingerprint == lm.fingerprint  # the source loads directly too
    ref = load_file(str(src / "reference.safetensors"))
    ids = ref["input_ids"]
    with torch.no_grad():
        whole, _ = lm(ids, lm.new_state(ids.shape[0]))
    assert (whole - ref["whole"]).abs().max().item() <= TOL
    for seed in range(2):
        chunks = chunked_logits(lm, ids, seed)
        assert (chunks - ref["whole"]).abs().max().item() <= TOL
        if case not in CACHE_DISAGREES:
            assert (chunks - ref["cached"]).abs().max().item() <= TOL
    # the tokenizer came along
    assert lm.tokenizer.encode("w3 w17") == [3, 17] and lm.tokenizer.decode([3, 17]) == "w3 w17"


@pytest.mark.parametrize("case", CASES)
def test_the_recurrent_state_matters_in_these_shapes(reference, case):
    """Zeroing the recurrent layers' state (their matrices, then their conv windows) after
    200 tokens moves the logits of the next ones by more than 1e-2: a reader that dropped
    it could not pass the parity above."""
    lm = hf_hybrid.read(reference[case])
    ids = load_file(str(reference[case] / "reference.safetensors"))["input_ids"]
    with torch.no_grad():
        _, state = lm(ids[:, :200], lm.new_state(2))
        want, _ = lm(ids[:, 200:230], state)
        for part in ("ssm", "conv"):
            moved, _ = lm(ids[:, 200:230], state.replace(**{part: torch.zeros_like(state[part])}))
            assert (moved - want).abs().max().item() >= 1e-2, part


def test_bounded_attention_is_exact_within_its_span_and_refuses_nothing(reference):
    src = reference["qwen35-rrra"]
    ids = load_file(str(src / "reference.safetensors"))["input_ids"]
    exact = hf_hybrid.read(src)
    bounded = model.load(src, device="cpu", options="attention=bounded,sinks=4,window=60")
    with torch.no_grad():
        a, _ = exact(ids, exact.new_state(2))
        b, state = bounded(ids, bounded.new_state(2))
    assert (a[:, :65] - b[:, :65]).abs().max().item() <= 1e-5  # every position within sinks + window + 1
    assert (a[:, 100:] - b[:, 100:]).abs().max().item() > 1e-3  # beyond it, the window slid
    assert state["k"].shape[2] == 60 and state["sink_k"].shape[2] == 4


def test_exact_attention_refuses_past_its_bound(reference):
    lm = model.load(reference["granite-ara-rope"], device="cpu", options="max_context=50")
    ids = torch.randint(2, 64, (1, 51))
    with torch.no_grad():
        _, state = lm(ids[:, :50], lm.new_state(1))
        with pytest.raises(ContextFull, match="50 that exact attention keeps"):
            lm(ids[:, 50:], state)


def test_what_does_not_convert_is_refused(reference, tmp_path):
    src = reference["qwen3next-rar"]
    hf = json.loads((src / "config.json").read_text())
    for change, match in [
        ({"num_experts": 4}, "mixture-of-experts"),
        ({"hidden_act": "gelu"}, "activation"),
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
        ({"linear_num_value_heads": 2}, "shape"),
        ({"model_type": "qwen3_5_moe"}, "mixture-of-experts"),
    ]:
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text(json.dumps({**hf, **change}))
        (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
        (bad / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
        with pytest.raises(ValueError, match=match):
            hf_hybrid.read(bad)
    granite = json.loads((reference["granite-rrar-nope"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**granite, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        hf_hybrid.read(bad)
