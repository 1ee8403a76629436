"""The LLaMA family as sinks + sliding-window state: the definition (a float64 reference
written from the module's docstring), the original model within the first S + W + 1
positions, boundary invariance within and beyond the window, batching streams of
different histories, bounded state, deltas of the filling sink axis, exact positions
millions of tokens deep, serving options and the int8 path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model
from model import attention
from model.checkpoint import build
from model.llama import Llama
from model.rotary import apply_rope, pair_of, rope_angles, rotate_twice
from model.state import StateError

from .conftest import assert_any_chunking_agrees, run_chunks

S, W = 2, 5  # sinks, window
TINY = dict(
    vocab_size=258, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=8, d_ff=48,
    sinks=S, window=W, tgt_len=4, rope_base=100.0,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0, **overrides: object) -> Llama:
    torch.manual_seed(seed)
    lm = build("llama", {**TINY, **overrides})
    with torch.no_grad():  # norms away from 1, so that their weights matter
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    lm.fingerprint = model.fingerprint(lm)
    return lm.eval()  # type: ignore[return-value]


# -- the definition, in float64 -------------------------------------------------------------
def rotate(x: torch.Tensor, pos: float, base: float) -> torch.Tensor:
    """x (..., hd) rotated by RoPE at position `pos` (rotate-half form), in float64."""
    hd = x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + half * sin


def reference_logits(lm: Llama, ids: list[int]) -> torch.Tensor:
    """Logits (N, V) by the module docstring's definition, position by position, no cache:
    the query at p sees sinks j < S at distance min(p, S+W) - j and the window
    max(S, p-W) <= j <= p at distance p - j."""
    c = lm.config
    sd = {k: v.double() for k, v in lm.state_dict().items()}
    H, kvh, hd = c.n_head, c.n_kv_head, c.head_dim

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    x = sd["tok_emb.weight"][ids]  # (N, d)
    N = len(ids)
    for i in range(c.n_layer):
        p = f"layers.{i}."
        q, k, v = (norm(x, sd[p + "norm1.weight"]) @ sd[p + "attn.qkv.weight"].T).split(
            [H * hd, kvh * hd, kvh * hd], -1
        )
        q, k, v = q.view(N, H, hd), k.view(N, kvh, hd), v.view(N, kvh, hd)
        out = torch.zeros(N, H, hd, dtype=torch.float64)
        for t in range(N):
            keys = [(j, min(t, c.sinks + c.window)) for j in range(min(c.sinks, t + 1))]
            keys += [(j, t) for j in range(max(c.sinks, t - c.window), t + 1)]
            for h in range(H):
                g = h // (H // kvh)
                s = torch.stack(
                    [rotate(q[t, h], qp, c.rope_base) @ rotate(k[j, g], j, c.rope_base) for j, qp in keys]
                )
                a = (s / math.sqrt(hd)).softmax(0)
                out[t, h] = sum(a[n] * v[j, g] for n, (j, _) in enumerate(keys))
        x = x + out.view(N, H * hd) @ sd[p + "attn.proj.weight"].T
        gate, up = (norm(x, sd[p + "norm2.weight"]) @ sd[p + "mlp.gate_up.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down.weight"].T
    return norm(x, sd["norm_out.weight"]) @ sd["head.weight"].T


def test_the_model_is_its_definition_within_and_beyond_the_window():
    lm = tiny(seed=1)
    ids = torch.randint(0, 258, (3 * (S + W),), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        got, _ = lm(torch.tensor([ids]))
    want = reference_logits(lm, ids)
    assert (got[0].double() - want).abs().max().item() <= 1e-4


def test_within_the_first_s_plus_w_positions_it_is_the_original_model():
    """Full causal attention up to position S + W; the next position drops its first
    non-sink key, so there the two differ."""
    lm = tiny(seed=2)
    full = tiny(seed=2, window=200)
    full.load_state_dict(lm.state_dict())
    ids = torch.randint(0, 258, (1, S + W + 2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, _ = lm(ids)
        b, _ = full(ids)
    assert (a[:, : S + W + 1] - b[:, : S + W + 1]).abs().max().item() <= 1e-6
    assert (a[:, S + W + 1] - b[:, S + W + 1]).abs().max().item() > 1e-4


# -- boundary invariance ---------------------------------------------------------------------
@st.composite
def stream_and_chunks(draw):
    length = draw(st.integers(S + W + 2, 4 * (S + W)))  # always beyond the window
    cuts = set(draw(st.sets(st.integers(1, length - 1), max_size=8)))
    ones = draw(st.lists(st.integers(1, length - 2), max_size=3))
    bounds = [0, *sorted(cuts | set(ones) | {o + 1 for o in ones}), length]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    return length, sizes, draw(st.integers(0, 2**16))


@settings(max_examples=12, deadline=None)
@given(case=stream_and_chunks())
def test_any_chunking_gives_the_same_logits_and_state(case):
    length, sizes, seed = case
    lm = tiny(seed=3)
    assert_any_chunking_agrees(lm, length, sizes, seed)


@settings(max_examples=10, deadline=None)
@given(
    history=st.tuples(st.integers(0, 3 * (S + W)), st.integers(0, 3 * (S + W))), seed=st.integers(0, 2**16)
)
def test_streams_of_different_histories_batch_as_they_run_alone(history, seed):
    """Left padding of the window and of the still-filling sinks changes nothing."""
    lm = tiny(seed=4)
    g = torch.Generator().manual_seed(seed)
    alone = []
    for h in history:
        st_ = lm.new_state(1)
        if h:
            _, st_ = lm(torch.randint(0, 258, (1, h), generator=g), st_)
        alone.append(st_)
    x = torch.randint(0, 258, (2, 7), generator=g)
    with torch.no_grad():
        batched, s_b = run_chunks(lm, x, [3, 1, 3], lm.stack_states(alone))
        for row, start in enumerate(alone):
            one, s_one = run_chunks(lm, x[row : row + 1], [7], start)
            assert (batched[row] - one[0]).abs().max().item() <= 1e-5
            split = lm.split_state(s_b)[row]
            for name, t in s_one.tensors.items():
                assert split[name].shape == t.shape and torch.allclose(
                    split[name].float(), t.float(), atol=1e-6
                )


def test_a_batched_decode_step_reads_the_window_where_it_lies():
    """A decode step of several streams copies no window: the attention reads each layer's
    keys and values in its arena (`model.llama._in_place`), where a matmul that folds the
    streams and the heads into one axis would copy all of them every step."""
    lm, B, window = tiny(window=48), 3, 48
    x = torch.randint(0, 258, (B, window + S + 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, state = lm(x, lm.new_state(B))
        _, state = lm(x[:, :1], state)  # the step that puts the state into an arena
        with torch.profiler.profile(record_shapes=True) as prof:
            _, state = lm(x[:, 1:2], state)
    kvh, hd = lm.config.n_kv_head, lm.config.head_dim
    copied = [
        shape
        for e in prof.events()
        if e.name == "aten::copy_"
        for shape in e.input_shapes
        if shape and math.prod(shape) >= B * kvh * window * hd
    ]
    assert state["k"].shape[2] == window and not copied


FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_a_decode_step_of_many_rows_runs_the_fused_kernel_as_each_row_alone():
    """One query per row and several rows: the window through torch's fused CPU attention
    kernel, the sinks joined by log-sum-exp (`model.attention._fused`), against each row
    decoded alone (one row keeps the two products: a path the fused one does not share),
    within fp32's reordering: rows whose every key is still a sink (the window masked
    whole), rows filling their sinks, rows with a full window, left-padded."""
    lm = tiny(seed=6)
    g = torch.Generator().manual_seed(6)
    alone = []
    for h in (0, 1, S + 1, S + W, 3 * (S + W)):
        st_ = lm.new_state(1)
        if h:
            _, st_ = lm(torch.randint(0, 258, (1, h), generator=g), st_)
        alone.append(st_)
    x = torch.randint(0, 258, (len(alone), 4), generator=g)
    with torch.no_grad():
        batched = lm.stack_states(alone)
        for t in range(x.shape[1]):
            with torch.profiler.profile() as prof:
                logits, batched = lm(x[:, t : t + 1], batched)
            assert sum(e.name == FUSED for e in prof.events()) == lm.config.n_layer
            for row, one in enumerate(alone):
                with torch.profiler.profile() as prof:
                    mine, alone[row] = lm(x[row : row + 1, t : t + 1], one)
                assert not any(e.name == FUSED for e in prof.events())
                assert (logits[row] - mine[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n", [0, 1, S + 1, S + W, 3 * (S + W)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_streams_decode_step_attends_as_the_general_layout_to_the_bit(n, dtype):
    """A batch-1 decode step's attention (`attention._one_query`: 3-D views of the keys and
    values where they lie in their arena, one `bmm` a product) gives what the general
    layout's products (`_apart`, which a chunk without sinks and the compiled step run)
    give for the same query, keys and values, to the bit: at a stream's first token (its
    own key its only sink), filling its sinks, at a full window and past it."""
    H, kvh, hd = 4, 2, 8
    M, Ms = min(n, W), min(n, S)
    sp = attention.span(torch.tensor([n]), 1, M, Ms, S, W, (hd, 100.0), torch.float32)
    g = torch.Generator().manual_seed(n)

    def rows(k: int) -> torch.Tensor:  # (1, k, kvh*hd), every other layer of an arena's rows
        return torch.randn(1, 2, k + 3, kvh * hd, generator=g)[:, 1, 1 : k + 1].to(dtype)

    q, q_sink = (torch.randn(1, 1, H * hd, generator=g).to(dtype) for _ in range(2))
    window, sinks = (rows(M + 1), rows(M + 1)), (rows(Ms + sp.n_new), rows(Ms + sp.n_new))
    one = attention.attend(q, q_sink, window, sinks, sp, kvh)
    heads = [attention._heads(x, kvh) for x in (*window, *sinks)]
    grouped = attention._grouped(q, kvh, hd), attention._grouped(q_sink, kvh, hd)
    general = attention._apart(
        grouped[0], grouped[1] if sp.sinks else None, (heads[0], heads[1]),
        (heads[2], heads[3]) if sp.sinks else None, (sp.sink, sp.window), 1,
    )  # fmt: skip
    as_attend = general.view(1, kvh, H // kvh, 1, hd).permute(0, 3, 1, 2, 4).reshape(1, 1, H * hd)
    assert torch.equal(one, as_attend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_turned_two_ways_at_once_is_each_turn_alone_to_the_bit(dtype):
    """`rotate_twice` (a query as the window and as the sinks see it, one swap of its
    halves for both) gives what `apply_rope` gives with each rotation alone, to the bit."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4 * 8, generator=g).to(dtype)
    pos = torch.randint(0, 10**6, (3, 5), generator=g)
    a, b = rope_angles(pos, 8, 100.0, torch.float32), rope_angles(pos.clamp(max=9), 8, 100.0, torch.float32)
    one, two = rotate_twice(x, pair_of(a, b), 4)
    assert torch.equal(one, apply_rope(x, a, 4)) and torch.equal(two, apply_rope(x, b, 4))


# -- the state -------------------------------------------------------------------------------
def test_the_state_stops_growing_past_s_plus_w():
    lm = tiny()
    state = lm.new_state(1)
    sizes = []
    with torch.no_grad():
        for t in range(3 * (S + W)):
            _, state = lm(torch.tensor([[t % 258]]), state)
            sizes.append(len(state.to_bytes()))
    grown = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert all(d > 0 for d in grown[: W - 1]) and all(d == 0 for d in grown[S + W :])
    assert state["k"].shape[2] == W and state["sink_k"].shape[2] == S


def test_deltas_carry_only_new_rows_and_rebuild_the_state():
    """A delta holds the new window rows and only the sink rows that are new: none once
    the sinks are full."""
    lm = tiny()
    g = torch.Generator().manual_seed(5)
    state, blob, since = lm.new_state(1), lm.new_state(1).to_bytes(), 0
    deltas = []
    with torch.no_grad():
        for n in (1, 1, 3, 9, 2):
            _, state = lm(torch.randint(0, 258, (1, n), generator=g), state)
            deltas.append(state.delta_bytes(since))
            since += n
    from model.state import read_blob

    assert read_blob(deltas[-1])[1]["sink_k"].shape[2] == 0  # past S tokens: no sink rows
    assert read_blob(deltas[1])[1]["sink_k"].shape[2] == 1  # the second token: one new sink
    back = lm.load_state(blob, deltas)
    for name in lm.persistent:
        assert torch.equal(back[name], state[name]), name
    assert "next_logits" not in back.tensors  # a cache: recomputed, the same
    assert torch.allclose(lm.next_logits(back), lm.next_logits(state), atol=1e-5)


def test_positions_stay_exact_millions_of_tokens_deep():
    """Shift a stream's window keys and position counter by D (keys rotated by D more):
    every distance a query sees is unchanged, so the logits must be too. Angles computed
    in fp32 would be off by ~D * 1e-7 radians and fail this."""
    lm = tiny(seed=6)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        _, state = lm(torch.randint(0, 258, (1, 3 * (S + W)), generator=g))
        x = torch.randint(0, 258, (1, 6), generator=g)
        want, _ = run_chunks(lm, x, [2, 1, 3], state)
        for D in (10**7, 3 * 10**9):
            k = state["k"]
            cs = rope_angles(
                torch.full(k.shape[:1] + k.shape[2:3], D), lm.config.head_dim, lm.config.rope_base, k.dtype
            )
            shifted = torch.stack(
                [apply_rope(k[:, i], cs, lm.config.n_kv_head) for i in range(k.shape[1])], 1
            )
            far = state.replace(k=shifted, n_tokens=state.n_tokens + D)
            got, _ = run_chunks(lm, x, [2, 1, 3], far)
            assert (got - want).abs().max().item() <= 1e-4, D


def test_a_state_of_other_shapes_is_refused():
    lm = tiny()
    with torch.no_grad():
        _, state = lm(torch.zeros(1, 3, dtype=torch.long))
    bad = state.replace(v=torch.cat([torch.zeros_like(state["v"][:, :, :1]), state["v"]], 2))  # padded: fits
    with pytest.raises(StateError, match="differ in shape"):
        lm.load_state(bad.to_bytes())
    too_many = state.replace(sink_k=torch.zeros(1, 2, S + 1, 16), sink_v=torch.zeros(1, 2, S + 1, 16))
    with pytest.raises(StateError, match="bound"):
        lm.load_state(too_many.to_bytes())


# -- serving options and int8 ------------------------------------------------------------------
def test_serving_options_set_the_span_and_the_fingerprint(tmp_path):
    model.init(tmp_path / "m", family="llama", seed=0, **{**TINY, "trained_context": 64})
    base = model.load(tmp_path / "m", device="cpu")
    lm = model.load(tmp_path / "m", device="cpu", options="window=9, sinks=1")
    assert (lm.config.window, lm.config.sinks, lm.context_window) == (9, 1, 11)
    assert lm.fingerprint != base.fingerprint  # a state made under other options is refused
    with pytest.raises(StateError, match="made by model"):
        lm.load_state(base.new_state(1).to_bytes())
    for bad, match in (
        ("heads=2", "no serving option heads"),
        ("window=x", "must be a int"),
        ("window", "name=value"),
    ):
        with pytest.raises(ValueError, match=match):
            model.load(tmp_path / "m", device="cpu", options=bad)
    with pytest.raises(ValueError, match="trained on"):
        model.load(tmp_path / "m", device="cpu", options={"window": 64})
    with pytest.raises(ValueError, match="no int8 path"):
        model.build("transformer-xl", {}).quantize()


def test_int8_keeps_every_invariant_and_stays_close():
    """Each row (token) is multiplied alone: batching changes nothing at all. Chunking moves
    a token between the two products (bfloat16 inputs below `PACKED_ROWS` rows, exact int8
    sums from there), so it stays within bfloat16's tolerance; the logits stay near fp32's."""
    lm = tiny(seed=7)
    tokens = torch.randint(0, 258, (2, 3 * (S + W)), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, _ = lm(tokens)
        lm.quantize()
        whole, _ = lm(tokens)
        chunked, _ = run_chunks(lm, tokens, [1, 4, 2, 1, 13])
        alone, _ = lm(tokens[1:])
    assert lm.precision == "int8"
    assert (whole - chunked).abs().max().item() <= 0.02 * whole.abs().max().item()
    assert torch.equal(whole[1:], alone)
    assert (whole - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
