"""Parity with the reference Transformer-XL (HF transformers 4.37.2) on pretrained-layout checkpoints.

The reference runs in a subprocess (tests/model/hf_reference.py) with the isolated
environment `.venv-ref/` on its path (`make ref-env`, which `make test` depends on):
transformers 4.37.2 needs numpy < 2 and an old huggingface-hub, which the main
environment must not have. It writes random `TransfoXLLMHeadModel` checkpoints with
`save_pretrained` and its log-probs over 3 consecutive segments with memory carried; here
recur loads those directories and must agree within 1e-4 on every log-prob.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from app.cli import main as recur_cli
from model.convert import convert

from .reference_env import LEGACY

REF_SCRIPT = Path(__file__).with_name("hf_reference.py")
TOL = 1e-4
TGT_LEN, SEGMENTS = 8, 3

BASE = dict(
    vocab_size=100,
    cutoffs=[20, 60],  # three clusters
    div_val=2,
    d_model=32,
    d_embed=64,  # != d_model: every cluster is projected
    n_head=2,
    d_head=16,
    d_inner=64,
    n_layer=2,
    mem_len=12,  # not a multiple of tgt_len: the memory is cut mid-segment
    clamp_len=0,
    same_length=False,
    untie_r=True,
    pre_lnorm=False,
    dropout=0.0,
)
CASES = {
    "untied_r-post_ln": dict(untie_r=True, pre_lnorm=False),
    "shared_r-post_ln": dict(untie_r=False, pre_lnorm=False),
    "untied_r-pre_ln": dict(untie_r=True, pre_lnorm=True),
    "shared_r-pre_ln": dict(untie_r=False, pre_lnorm=True),
    # the published evaluation mode: same_length with clamped relative distances
    "same_length-clamp": dict(same_length=True, clamp_len=5),
    # one output layer over the whole vocabulary, projections tied to the input's
    "div_val_1-clamp": dict(div_val=1, d_embed=48, clamp_len=3),
}
BIN_CASES = frozenset({"shared_r-post_ln", "untied_r-pre_ln"})  # saved as pytorch_model.bin


def make_reference(
    out: Path, cases: dict[str, dict], bin_cases: frozenset[str] = frozenset()
) -> dict[str, Path]:
    """Run the reference subprocess: name -> a save_pretrained directory with reference.safetensors.

    Skips (loudly) only when the reference environment is absent and cannot be built.
    """
    spec = [
        {
            "name": name,
            "config": {**BASE, **over},
            "tgt_len": TGT_LEN,
            "segments": SEGMENTS,
            "batch": 2,
            "safe_serialization": name not in bin_cases,
            "seed": i,
        }
        for i, (name, over) in enumerate(cases.items())
    ]
    (out / "cases.json").write_text(json.dumps(spec))
    LEGACY.run(REF_SCRIPT, out, out / "cases.json", home=out / "hf-home")
    return {name: out / name for name in cases}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_reference(tmp_path_factory.mktemp("hf-reference"), CASES, BIN_CASES)


def _ref(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(directory / "reference.safetensors"))
    return t["input_ids"], t["logprobs"]


def _segments(lm: model.LanguageModel, ids: torch.Tensor, state: model.State | None = None) -> torch.Tensor:
    state = state or lm.new_state(ids.shape[0])
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], TGT_LEN):
            logits, state = lm(ids[:, s : s + TGT_LEN], state)
            out.append(torch.log_softmax(logits, -1))
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_logprobs_match_reference(reference, name):
    directory = reference[name]
    assert (directory / ("pytorch_model.bin" if name in BIN_CASES else "model.safetensors")).is_file()
    ids, ref = _ref(directory)
    lm = model.load(directory, device="cpu")  # the HF directory, directly
    assert lm.config.adaptive and lm.config.attention == "segment" and lm.config.tgt_len == 128
    got = _segments(lm, ids)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{name}: max |logprob - reference| = {diff:.2e}"


@pytest.mark.parametrize("name", ["untied_r-post_ln", "shared_r-pre_ln", "same_length-clamp"])
def test_scoring_path_matches_reference(reference, name, tmp_path):
    """Converted checkpoint, `consume` in tgt_len segments from the start, state through bytes."""
    ids, ref = _ref(reference[name])
    assert (
        recur_cli(["convert", str(reference[name]), str(tmp_path / "native"), "--tgt-len", str(TGT_LEN)]) == 0
    )
    lm = model.load(tmp_path / "native", device="cpu")
    assert lm.config.tgt_len == TGT_LEN
    want = ref[:, :-1].gather(2, ids[:, 1:, None])[..., 0]  # reference log p(token t+1 | ...)
    # one call: consume cuts it into tgt_len segments from its start
    lp, _ = lm.consume(ids, lm.new_state(2))
    assert torch.isnan(lp[:, 0]).all()
    assert (lp[:, 1:] - want).abs().max().item() <= TOL
    # one request per segment, the state carried through its byte form between them
    state, parts = lm.new_state(2), []
    for s in range(0, ids.shape[1], TGT_LEN):
        state = lm.load_state(state.to_bytes())
        part, state = lm.consume(ids[:, s : s + TGT_LEN], state)
        parts.append(part)
    assert (torch.cat(parts, 1)[:, 1:] - want).abs().max().item() <= TOL


def test_same_length_is_chunking_invariant(reference):
    """With same_length every query sees exactly mem_len positions, so any cut gives the reference."""
    ids, ref = _ref(reference["same_length-clamp"])
    lm = model.load(reference["same_length-clamp"], device="cpu")
    want = ref[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    state, parts, start = lm.new_state(2), [], 0
    for n in [1, 5, 2, 11, 1, 4]:
        part, state = lm.consume(ids[:, start : start + n], state)
        parts.append(part)
        start += n
    assert start == ids.shape[1]
    assert (torch.cat(parts, 1)[:, 1:] - want).abs().max().item() <= TOL


def test_converted_checkpoint_is_the_same_model(reference, tmp_path):
    src = reference["shared_r-pre_ln"]
    direct = model.load(src, device="cpu")
    convert(src, tmp_path / "native")
    converted = model.load(tmp_path / "native", device="cpu")
    assert converted.fingerprint == direct.fingerprint
    meta = json.loads((tmp_path / "native" / "config.json").read_text())
    assert meta["family"] == "transformer-xl" and meta["config"]["cutoffs"] == [20, 60]
    assert json.loads((tmp_path / "native" / "tokenizer.json").read_text())["kind"] == "word"
    ids, _ = _ref(src)
    _, state = direct(ids[:, :TGT_LEN], direct.new_state(2))
    resumed = converted.load_state(state.to_bytes())  # states move between the two
    # last_hidden is a strided view (h[:, -1]) in the live state, a contiguous copy once
    # resumed: the same values, read by kernels that may sum in another order on another CPU
    torch.testing.assert_close(converted.next_logits(resumed), direct.next_logits(state), atol=1e-6, rtol=0)


def test_original_layout_without_prefix_and_legacy_bin(reference, tmp_path):
    """The original code's state dict: no "transformer." prefix, every tied copy present,
    in torch's legacy (pre-zip) .bin format."""
    src = reference["untied_r-post_ln"]
    ids, ref = _ref(src)
    hf_model = model.load(src, device="cpu")
    _copy(src, tmp_path, "config.json", "vocab.txt")
    original = {
        k.removeprefix("transformer."): v for k, v in load_file(str(src / "model.safetensors")).items()
    }
    for i in range(3):  # the tied output layers, saved again as the original did
        original[f"crit.out_layers.{i}.weight"] = original[f"word_emb.emb_layers.{i}.weight"]
    torch.save(original, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    lm = model.load(tmp_path, device="cpu")
    assert lm.fingerprint == hf_model.fingerprint
    assert (_segments(lm, ids) - ref).abs().max().item() <= TOL


def test_tied_weights_are_shared_not_copied(reference):
    lm = model.load(reference["same_length-clamp"], device="cpu")
    emb, crit = lm.word_emb, lm.crit
    for i in range(3):
        assert crit.out_layers[i].weight is emb.emb_layers[i].weight
    assert crit.out_projs[0] is not emb.emb_projs[0]  # tie_projs = [False, True, True]
    assert crit.out_projs[1] is emb.emb_projs[1] and crit.out_projs[2] is emb.emb_projs[2]


def _copy(src: Path, dst: Path, *names: str) -> None:
    """Copy the files `names` of the checkpoint `src` into `dst`."""
    for name in names:
        (dst / name).write_bytes((src / name).read_bytes())


class _Payload:
    """Anything that is not a tensor: unpickling it would run arbitrary code."""


def test_bin_with_code_is_refused(reference, tmp_path):
    _copy(reference["untied_r-pre_ln"], tmp_path, "config.json", "vocab.txt")
    torch.save({"weights": _Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        model.load(tmp_path, device="cpu")


def test_missing_or_wrong_vocabulary_is_a_clear_error(reference, tmp_path):
    _copy(reference["untied_r-post_ln"], tmp_path, "config.json", "model.safetensors")
    with pytest.raises(FileNotFoundError, match="vocab.txt"):
        model.load(tmp_path, device="cpu")
    (tmp_path / "vocab.txt").write_text("<eos>\n<unk>\nthe\n")
    with pytest.raises(ValueError, match="3 symbols, the model's vocab_size is 100"):
        model.load(tmp_path, device="cpu")


def test_weights_that_do_not_fit_the_config_are_named(reference, tmp_path):
    src = reference["untied_r-post_ln"]
    _copy(src, tmp_path, "model.safetensors", "vocab.txt")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    with pytest.raises(ValueError, match=r"missing \['layers\.2\."):
        model.load(tmp_path, device="cpu")
