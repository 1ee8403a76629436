"""Parity with HF transformers' own Mamba and Mamba-2 (their PyTorch paths, on CPU).

The reference runs once per module in a subprocess (tests/model/hf_ssm_reference.py) with
the isolated current-transformers environment `.venv-ref-current/` on its path (`make
ref-env`, which `make test` depends on). It writes random `MambaForCausalLM` /
`Mamba2ForCausalLM` checkpoints with `save_pretrained` (and a word-level tokenizer.json),
the logits of a whole sequence, the logits of the same sequence fed as a prompt then token
by token through the cache, and greedy generation. Here `recur convert` and `model.load`
read those directories and must agree within 1e-4 on every logit, and exactly on the
generated tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from app.cli import main as recur_cli
from model import hf_ssm
from model.convert import convert

from .reference_env import CURRENT

REF_SCRIPT = Path(__file__).with_name("hf_ssm_reference.py")
TOL = 1e-4
BASE = dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
CASES = {
    # untied head, biases everywhere, an explicit Delta rank
    "mamba-bias-untied": ("mamba", dict(time_step_rank=4, use_bias=True, tie_word_embeddings=False)),
    # the published defaults: tied head, rank "auto", here no conv bias
    "mamba-tied": ("mamba", dict(use_conv_bias=False, tie_word_embeddings=True)),
    # two groups of heads sharing B and C; SSD chunks of 5 that do not divide the prompt
    "mamba2-groups": ("mamba2", dict(num_heads=8, head_dim=8, n_groups=2, chunk_size=5, use_bias=True)),
    # one group, a tied head, a chunk longer than the whole sequence
    "mamba2-tied": ("mamba2", dict(num_heads=4, head_dim=16, n_groups=1, chunk_size=64, tie_word_embeddings=True)),
}
LENGTH, PROMPT = 23, 9


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf-ssm")
    spec = [
        {"name": name, "kind": kind, "config": {**BASE, **over}, "batch": 2, "length": LENGTH, "prompt": PROMPT, "seed": i}
        for i, (name, (kind, over)) in enumerate(CASES.items())
    ]
    (out / "cases.json").write_text(json.dumps(spec))
    CURRENT.run(REF_SCRIPT, out, out / "cases.json", home=out / "hf-home")
    return {name: out / name for name in CASES}


def cached_logits(lm: model.LanguageModel, ids: torch.Tensor) -> torch.Tensor:
    """The prompt in one call, then every later token alone (generation's path)."""
    with torch.no_grad():
        out, state = lm(ids[:, :PROMPT], lm.new_state(ids.shape[0]))
        steps = [out]
        for t in range(PROMPT, ids.shape[1]):
            out, state = lm(ids[:, t : t + 1], state)
            steps.append(out)
    return torch.cat(steps, 1)


def greedy(lm: model.LanguageModel, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        _, state = lm(ids[:, :PROMPT], lm.new_state(ids.shape[0]))
        out = []
        for _ in range(n):
            nxt = lm.next_logits(state).argmax(-1)
            out.append(nxt)
            _, state = lm(nxt[:, None], state)
    return torch.stack(out, 1)


@pytest.mark.parametrize("case", CASES)
def test_converted_checkpoints_match_transformers(reference, tmp_path, capsys, case):
    src = reference[case]
    assert recur_cli(["convert", str(src), str(tmp_path / "native")]) == 0
    printed = json.loads(capsys.readouterr().out)
    lm = model.load(tmp_path / "native", device="cpu")
    assert lm.family == CASES[case][0] == printed["family"] and lm.fingerprint == printed["fingerprint"]
    assert model.load(src, device="cpu").fingerprint == lm.fingerprint  # the source loads directly too
    ref = load_file(str(src / "reference.safetensors"))
    ids = ref["input_ids"]
    with torch.no_grad():
        whole, _ = lm(ids, lm.new_state(ids.shape[0]))
    assert (whole - ref["whole"]).abs().max().item() <= TOL
    assert (cached_logits(lm, ids) - ref["cached"]).abs().max().item() <= TOL
    ours = greedy(lm, ids, ref["generated"].shape[1])
    for row, want in zip(ours.tolist(), ref["generated"].tolist(), strict=True):
        n = want.index(0) + 1 if 0 in want else len(want)  # generate stops at <eos> (0), then pads
        assert row[:n] == want[:n]
    # the tokenizer came along
    assert lm.tokenizer.encode("w3 w17") == [3, 17] and lm.tokenizer.decode([3, 17]) == "w3 w17"
    assert (lm.tokenizer.bos_id, lm.tokenizer.eos_id, lm.tokenizer.vocab_size) == (1, 0, 64)


def test_a_serving_chunk_override_changes_no_logit(reference, tmp_path):
    src = reference["mamba2-groups"]
    lm = convert(src, tmp_path / "native", tgt_len=4)
    assert lm.segment_len == 4
    ids = load_file(str(src / "reference.safetensors"))["input_ids"]
    lp, _ = lm.consume(ids, lm.new_state(ids.shape[0]))  # in chunks of 4
    want, _ = model.load(src, device="cpu").consume(ids, lm.new_state(ids.shape[0]))
    torch.testing.assert_close(lp[:, 1:], want[:, 1:], atol=TOL, rtol=0)


def test_what_does_not_convert_is_refused(reference, tmp_path):
    src = reference["mamba-tied"]
    hf = json.loads((src / "config.json").read_text())
    for change, match in [
        ({"hidden_act": "gelu"}, "published Mamba variants"),
        ({"model_type": "jamba"}, "not mamba or mamba2"),
        ({"intermediate_size": 96}, "intermediate_size"),
        ({"state_size": 4}, "shape"),
    ]:
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text(json.dumps({**hf, **change}))
        (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
        (bad / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
        with pytest.raises(ValueError, match=match):
            hf_ssm.read(bad)
    (bad / "config.json").write_text(json.dumps(hf))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        hf_ssm.read(bad)  # 64 ids cannot hold bytes: no tokenizer to fall back on
