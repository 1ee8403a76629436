"""A state's precision (model/state/precision.py): the families whose state is a cache of
keys and values round each row as it is appended, so a text gives the same answer in one
request or in many at every precision, and store it compact.

The invariance tests run the models in float64. The property is structural (the rows a
query reads never depend on where a boundary fell), and float64 shows it exactly: the
stored caches agree to the bit. In float32 a last-bit difference between two chunkings
(a matmul over more rows, a softmax over more keys) can move a value across a rounding
step, as it can an int8 weight's input (model/int8.py); docs/BENCHMARKS.md measures what
that costs a real model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model
from model.state import StateError
from model.state import precision as grid
from tests.sensitive import sensitive_model

from .conftest import tiny_ssm

CONFIGS: dict[str, dict] = {
    "llama": dict(
        vocab_size=258, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=16, d_ff=48,
        sinks=2, window=5, tgt_len=4,
    ),
    "transformer-xl": dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=6, tgt_len=8, dropout=0.0),
    "rlt": dict(
        n_encoder_layers=1, n_decoder_layers=2, d_model=32, n_head=2, d_ff=64, window=4, max_context=7, tgt_len=8
    ),
}  # fmt: skip
ROUNDED = ("bfloat16", "float16", "int8")
LENGTH = 24  # past every config's window


def kept_at(family: str, precision: str, dtype: torch.dtype = torch.float64) -> model.LanguageModel:
    lm = sensitive_model(family, CONFIGS[family]).to(dtype)
    assert lm.set_state_dtype(precision) == "float32"  # kept in the state: nothing rounds at commit
    return lm


def caches(lm: model.LanguageModel, state: model.State) -> list[str]:
    return [name for name in lm.time_axes() if name in lm.persistent]


def in_requests(
    lm: model.LanguageModel, tokens: torch.Tensor, cuts: list[int]
) -> tuple[torch.Tensor, model.State]:
    """`tokens` (1, T) fed as requests cut at `cuts`, the state stored and loaded between
    them, each in place as the server runs it: the log-probs of all of them, and the state."""
    state, parts = lm.new_state(1), []
    for a, b in zip([0, *cuts], [*cuts, tokens.shape[1]], strict=True):
        lp, state = lm.consume(tokens[0, a:b], state)
        parts.append(lp)
        state = lm.load_state(state.to_bytes())
    return torch.cat(parts, 1), state


@pytest.mark.parametrize("precision", ROUNDED)
@pytest.mark.parametrize("family", sorted(CONFIGS))
@settings(max_examples=4, deadline=None)
@given(cuts=st.sets(st.integers(1, LENGTH - 1), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_a_text_split_into_requests_reads_the_same_rows(family, precision, cuts, seed):
    """One request, or many cut anywhere (each state through its bytes): the same log-probs,
    and the same stored caches to the bit."""
    lm = kept_at(family, precision)
    tokens = torch.randint(0, 258, (1, LENGTH), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        whole, s_whole = lm(tokens)
    split, s_split = in_requests(lm, tokens, sorted(cuts))
    lp = torch.log_softmax(whole.double(), -1)[0, :-1].gather(1, tokens[0, 1:, None])[:, 0]
    assert (split[0, 1:].double() - lp).abs().max().item() <= 1e-5  # (consume's log-probs are float32)
    assert s_whole.precision == s_split.precision == precision
    for name in caches(lm, s_whole):
        assert torch.equal(s_whole[name], s_split[name]), name
        assert torch.equal(grid.snap(s_whole[name], precision), s_whole[name]), name  # on the grid


def test_rounding_at_commit_would_break_it():
    """The reference above can tell: rounding a float32 state only when it is stored (what
    --state-dtype did before) moves the log-probs after a boundary by far more."""
    lm = kept_at("llama", "float32")
    tokens = torch.randint(0, 258, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = lm(tokens)
        _, state = lm(tokens[:, :9])
        state = lm.load_state(state.to_bytes("bfloat16"))
        after, _ = lm(tokens[:, 9:], state)
    assert (after - whole[:, 9:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("precision", ROUNDED)
def test_rlt_compiled_step_rounds_as_its_chunk_does(precision):
    """RLT's fixed-shape step (what a compiled `decode_token` runs) rounds each new key and
    value before its own query reads it, as the chunked decoder does."""
    lm = kept_at("rlt", precision)
    tokens = torch.randint(0, 258, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    fixed = model.Execution(parts={"decode_token": lm.decode_token})
    with torch.no_grad():
        plain, s_plain = lm(tokens[:, :10])
        plain2, s_plain = lm(tokens[:, 10:], s_plain)
        steps, s_steps = lm(tokens[:, :10], None, fixed)
        steps2, s_steps = lm(tokens[:, 10:], s_steps, fixed)
    assert (torch.cat([plain, plain2], 1) - torch.cat([steps, steps2], 1)).abs().max().item() <= 1e-9
    for name in caches(lm, s_plain):
        assert torch.equal(s_plain[name], s_steps[name]), name


def test_a_batch_reads_each_stream_as_it_runs_alone():
    lm = kept_at("llama", "int8")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 258, (1, 9), generator=g), torch.randint(0, 258, (1, 4), generator=g)
    nxt = torch.randint(0, 258, (2, 5), generator=g)
    with torch.no_grad():
        alone = [lm(x, None)[1] for x in (a, b)]
        batched, _ = lm(nxt, lm.stack_states(alone))
        for row, start in enumerate(alone):
            one, _ = lm(nxt[row : row + 1], start)
            assert (batched[row] - one[0]).abs().max().item() <= 1e-9


# -- bytes ---------------------------------------------------------------------------------
def test_state_bytes_are_half_and_about_a_quarter_of_float32():
    """A real LLM's layout (SmolLM2's: 3 key/value heads of 64) at a full window."""
    cfg = dict(
        vocab_size=64, n_layer=2, d_model=64, n_head=3, n_kv_head=3, head_dim=64, d_ff=64, sinks=4, window=252
    )
    sizes = {}
    for precision in ("float32", *ROUNDED):
        torch.manual_seed(0)
        lm = model.build("llama", cfg).eval()
        lm.set_state_dtype(precision)
        with torch.no_grad():
            _, state = lm(torch.randint(0, 64, (1, 300)))
        blob = state.to_bytes()
        sizes[precision] = len(blob)
        loaded = lm.load_state(blob)
        for name in caches(lm, state):  # and they come back to the bit
            assert torch.equal(loaded[name], state[name]), name
    assert sizes["bfloat16"] / sizes["float32"] <= 0.51
    assert sizes["float16"] / sizes["float32"] <= 0.51
    assert sizes["int8"] / sizes["float32"] <= 0.27


def test_deltas_of_an_int8_state_rebuild_it_exactly():
    lm = kept_at("llama", "int8", torch.float32)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 3), generator=g))
        snapshot, deltas = state.to_bytes(), []
        for n in (1, 2, 6):
            since = int(state.n_tokens[0])
            _, state = lm(torch.randint(0, 258, (1, n), generator=g), state)
            deltas.append(state.delta_bytes(since))
    rebuilt = lm.load_state(snapshot, deltas)
    for name in lm.persistent:
        assert torch.equal(rebuilt[name], state[name]), name


# -- a state of another precision, and blobs that lie ----------------------------------------
def test_a_state_of_another_precision_is_converted_on_load():
    """Into a finer grid nothing changes (int8 -> float32); into a coarser one its caches are
    rounded onto it, once (float32 -> int8): from there on it is an int8 state."""
    fine, coarse = kept_at("llama", "float32", torch.float32), kept_at("llama", "int8", torch.float32)
    tokens = torch.randint(0, 258, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, s8 = coarse(tokens)
        _, s32 = fine(tokens)
    up = fine.load_state(s8.to_bytes())
    down = coarse.load_state(s32.to_bytes())
    assert (up.precision, down.precision) == ("float32", "int8")
    for name in caches(fine, s8):
        assert torch.equal(up[name], s8[name])
        assert torch.equal(down[name], grid.snap(s32[name], "int8"))
        assert not torch.equal(down[name], s32[name])


def blob_with(blob: bytes, header: dict | None = None, **tensors: torch.Tensor | None) -> bytes:
    """A state blob rewritten as a liar would: fields of its recur header changed, and its
    tensors (None drops one), the checksum made to fit."""
    import json

    from safetensors.torch import load, save

    stored = load(blob)
    n = int.from_bytes(blob[:8], "little")
    recur = {**json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["recur"]), **(header or {})}
    for name, t in tensors.items():
        if t is None:
            stored.pop(name)
        else:
            stored[name] = t.contiguous()  # (a live state's window is a view of its arena)
    recur["shapes"] = {k: list(v.shape) for k, v in stored.items()}
    recur["checksum"] = model.state.checksum_of(stored)
    return save(stored, metadata={"recur": json.dumps(recur)})


def test_an_import_is_checked_against_its_precision():
    lm = kept_at("llama", "int8", torch.float32)
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 8), generator=torch.Generator().manual_seed(6)))
    blob = state.to_bytes()
    assert torch.equal(lm.load_state(blob)["k"], state["k"])
    k, exp = state["k"], grid.pack("k", state["k"], "int8")["k.exp"]
    lies = {
        "an unknown precision": blob_with(blob, {"precision": "int4"}),
        "int8 caches without exponents": blob_with(blob, **{"k.exp": None}),
        "exponents of another shape": blob_with(blob, **{"k.exp": exp[..., :0]}),
        "float exponents": blob_with(blob, **{"k.exp": exp.float()}),
        "a float cache in an int8 state": blob_with(blob, k=k),
        "an int8 cache in a bfloat16 state": blob_with(blob, {"precision": "bfloat16"}),
        "exponents in a float32 state": blob_with(blob, {"precision": "float32"}),
    }
    for why, lie in lies.items():
        with pytest.raises(StateError):
            lm.load_state(lie)
            pytest.fail(why)


def test_a_family_without_a_cache_keeps_float32_states():
    """Mamba's state is no cache of keys and values: it keeps float32 and the server rounds
    it when stored, as before (bfloat16, float16); int8 is refused, before any state exists."""
    lm = tiny_ssm("mamba")
    assert lm.set_state_dtype("bfloat16") == "bfloat16"
    assert lm.new_state(1).precision == "float32"
    with pytest.raises(ValueError, match="not a cache of keys and values"):
        lm.set_state_dtype("int8")
    with pytest.raises(ValueError, match="state precision"):
        lm.set_state_dtype("int4")


def test_states_of_two_precisions_never_share_a_batch():
    a, b = kept_at("llama", "int8"), kept_at("llama", "bfloat16")
    with pytest.raises(StateError, match="batch"):
        model.State.stack([a.new_state(1), b.new_state(1)])
