"""The hybrid families on their own: the Gated DeltaNet's chunkwise (WY) form against its
recurrence, boundary invariance in any chunking (both families, both attention modes),
batched = alone with rows of different lengths, growing in place = functionally, the two
attention modes' state sizes, exact attention's bound, and the state bytes."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model
from app.cli import main as recur_cli
from model.gdn_hybrid import delta_chunks, delta_step
from model.hybrid import ContextFull
from model.state import ARENA_SLACK, StateError
from tests.sensitive import sensitive_model

from .conftest import run_chunks

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(d_model=16, n_head=2, n_kv_head=1, head_dim=8, d_ff=32, chunk_size=3, tgt_len=8)
TINY = {
    "gdn-hybrid": dict(BASE, pattern="rar", rope_dim=4, n_k_heads=1, n_v_heads=2, k_head_dim=8, v_head_dim=8),
    "mamba2-hybrid": dict(BASE, pattern="arr", rope_dim=0, d_state=8, ssm_head_dim=8, n_groups=2),
}
MODES = {
    "exact": dict(attention="exact", max_context=512),
    "bounded": dict(attention="bounded", sinks=2, window=9),
}
CASES = [(f, m) for f in TINY for m in MODES]


def tiny(family: str, mode: str, seed: int = 1) -> model.LanguageModel:
    return sensitive_model(family, {**TINY[family], **MODES[mode]}, seed)


@pytest.mark.parametrize("T", [1, 2, 5, 8, 9, 40])
@pytest.mark.parametrize("C", [1, 4, 8])
def test_the_chunkwise_form_is_the_recurrence(T, C):
    """delta_chunks (the WY form, chunks of C) against delta_step token by token, from a
    nonzero state, with decays from none to strong and keys normalised as the layer has them."""
    g = torch.Generator().manual_seed(T * 10 + C)
    b, H, dk, dv = 2, 3, 5, 4
    q = torch.randn(b, H, T, dk, generator=g) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, H, T, dk, generator=g), dim=-1)
    v = torch.randn(b, H, T, dv, generator=g)
    decay = -torch.rand(b, H, T, generator=g) * 3
    beta = torch.rand(b, H, T, generator=g)
    S0 = torch.randn(b, H, dk, dv, generator=g)
    o, S = delta_chunks(q, k, v, decay, beta, S0, C)
    steps, St = [], S0
    for t in range(T):
        ot, St = delta_step(q[:, :, t], k[:, :, t], v[:, :, t], decay[:, :, t], beta[:, :, t], St)
        steps.append(ot)
    torch.testing.assert_close(o, torch.stack(steps, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(S, St, atol=1e-5, rtol=0)


@st.composite
def stream_and_chunks(draw):
    length = draw(st.integers(2, 40))
    cuts = draw(st.sets(st.integers(1, length - 1), max_size=6))
    bounds = [0, *sorted(cuts), length]
    return length, [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], draw(st.integers(0, 2**16))


@pytest.mark.parametrize(("family", "mode"), CASES)
@settings(max_examples=8, deadline=None)
@given(case=stream_and_chunks())
def test_any_chunking_gives_the_same_logits_and_state(family, mode, case):
    """Fed whole, in chunks and token by token: the logits within 1e-4 (as every family's)
    relative to their largest magnitude, and every persistent state tensor within 1e-4
    relative (these unit-gain models' logits reach tens, and a gated norm after a Gated
    DeltaNet head scales its rounding up: one example reached 1.16e-4 on logits of 12.6)."""
    length, sizes, seed = case
    lm = tiny(family, mode)
    tokens = torch.randint(0, 258, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        whole, s_whole = run_chunks(lm, tokens, [length])
        ends = [run_chunks(lm, tokens, sizes), run_chunks(lm, tokens, [1] * length)]
    for logits, state in ends:
        assert (whole - logits).abs().max().item() <= 1e-4 * max(1.0, whole.abs().max().item())
        for name in lm.persistent:
            assert s_whole[name].shape == state[name].shape, name
            torch.testing.assert_close(state[name].float(), s_whole[name].float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_a_batch_of_different_histories_runs_as_each_alone(family, mode):
    """Rows of 3, 11 and 17 tokens (left-padded keys, the bounded window full in one),
    prefilled then decoded together, growing in place: each row's logits and state are its
    own alone, past several arena reallocations."""
    lm = tiny(family, mode)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 258, (1, n), generator=g) for n in (3, 11, 17)]
    nxt = torch.randint(0, 258, (3, 4 + ARENA_SLACK + 3), generator=g)
    with torch.no_grad():
        alone = [run_chunks(lm, torch.cat([r, nxt[i : i + 1]], 1), [r.shape[1], 4] + [1] * (nxt.shape[1] - 4)) for i, r in enumerate(rows)]  # fmt: skip
        batch = lm.stack_states([lm(r)[1] for r in rows])
        out, batch = lm(nxt[:, :4], batch, model.IN_PLACE)
        logits = [out]
        for t in range(4, nxt.shape[1]):
            out, batch = lm(nxt[:, t : t + 1], batch, model.IN_PLACE)
            logits.append(out)
    together = torch.cat(logits, 1)
    for i, (want, want_state) in enumerate(alone):
        # (unit-gain weights: batched matmuls round otherwise, and the logits reach tens; the
        # rounding is the CPU's GEMMs': under 1e-4 with AVX-512's, 2.3e-4 with AVX2's on an
        # AMD EPYC, after 20 steps of recurrence. A row that saw another's history is off by
        # whole units)
        torch.testing.assert_close(together[i], want[0, rows[i].shape[1] :], atol=5e-4, rtol=1e-5)
        got = lm.split_state(batch)[i]
        for name in lm.persistent:
            torch.testing.assert_close(got[name].float(), want_state[name].float(), atol=1e-5, rtol=1e-5)


def test_exact_and_bounded_agree_within_the_span_and_size_as_promised():
    exact, bounded = tiny("gdn-hybrid", "exact"), tiny("gdn-hybrid", "bounded")
    bounded.load_state_dict(exact.state_dict())
    tokens = torch.randint(0, 258, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, sa = exact(tokens)
        b, sb = bounded(tokens)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-5, rtol=0)  # sinks + window + 1 = 12
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3
    assert sa["k"].shape[2] == 40 and sb["k"].shape[2] == 9 and sb["sink_k"].shape[2] == 2
    recurrent = sum(sa[n].numel() for n in ("conv", "ssm"))
    assert recurrent == sum(sb[n].numel() for n in ("conv", "ssm"))  # the recurrent part: one size


def test_exact_attention_refuses_a_chunk_past_its_bound_and_consumes_nothing():
    lm = sensitive_model("mamba2-hybrid", {**TINY["mamba2-hybrid"], "max_context": 20})
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 18)))
        with pytest.raises(ContextFull, match="18 tokens and 3 more would pass the 20"):
            lm(torch.randint(0, 258, (1, 3)), state)
        _, state = lm(torch.randint(0, 258, (1, 2)), state)  # up to the bound exactly
    assert int(state.n_tokens[0]) == 20


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_state_bytes_round_trip_and_other_shapes_are_refused(family, mode):
    lm = tiny(family, mode)
    tokens = torch.randint(0, 258, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, state = lm(tokens[:, :20])
        want, _ = lm(tokens[:, 20:], state)
        got, _ = lm(tokens[:, 20:], lm.load_state(state.to_bytes()))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert len(state.to_bytes()) <= lm.max_state_bytes()
    other = model.build(family, {**TINY[family], **MODES[mode], "pattern": "rrra"})
    with pytest.raises(StateError, match="made by model"):
        lm.load_state(other.new_state(1).to_bytes())


@pytest.mark.parametrize(("arch", "name"), [("qwen35", "Qwen3.5"), ("granitehybrid", "Granite-4.0-H")])
def test_a_hybrids_gguf_is_refused_naming_what_is_missing(tmp_path, capsys, arch, name):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    names_it = (
        f"a {name} hybrid .*recur convert HF_DIR.*lacks the mapping of llama.cpp's recurrent-layer tensors"
    )
    with pytest.raises(ValueError, match=names_it):
        model.load(path, device="cpu")
    # `recur convert` says the same, without a traceback, and writes nothing
    assert recur_cli(["convert", str(path), str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert re.match(f"recur convert: .*{names_it}", said) and "Traceback" not in said
    assert not (tmp_path / "out").exists()
