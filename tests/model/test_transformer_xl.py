"""Transformer-XL: chunk invariance, causality, bounded state, StopGrad, batching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model.transformer_xl import rel_shift
from tests.conftest import examples

from .conftest import logits_with_one_token_changed, tiny_txl

MEM = 8


def run_chunks(lm, tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, out, i = lm.new_state(tokens.shape[0]), [], 0
    for n in sizes:
        logits, state = lm(tokens[:, i : i + n], state)
        out.append(logits)
        i += n
    assert i == tokens.shape[1]
    return torch.cat(out, 1)


@st.composite
def stream_and_chunks(draw):
    length = draw(st.integers(3 * MEM, 6 * MEM))
    cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=12)))
    # always include some size-1 chunks
    ones = draw(st.lists(st.integers(1, length - 2), max_size=4))
    cuts = sorted(set(cuts) | set(ones) | {o + 1 for o in ones})
    bounds = [0, *cuts, length]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    seed = draw(st.integers(0, 2**16))
    return length, sizes, seed


@pytest.mark.parametrize("pre_lnorm", [False, True])
@examples(25)
@given(case=stream_and_chunks())
def test_chunk_invariance(pre_lnorm, case):
    length, sizes, seed = case
    lm = tiny_txl(seed=1, pre_lnorm=pre_lnorm, final_norm=pre_lnorm)
    tokens = torch.randint(0, 258, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        whole = run_chunks(lm, tokens, [length])
        chunked = run_chunks(lm, tokens, sizes)
        one_by_one = run_chunks(lm, tokens, [1] * length)
    assert (whole - chunked).abs().max().item() <= 1e-4
    assert (whole - one_by_one).abs().max().item() <= 1e-4


def test_next_logits_come_from_the_state(txl):
    tokens = torch.randint(0, 258, (2, 30))
    with torch.no_grad():
        logits, state = txl(tokens, txl.new_state(2))
        assert torch.allclose(txl.next_logits(state), logits[:, -1], atol=1e-5)


def test_memory_actually_carries_context(txl):
    """Tokens beyond the current chunk must influence the logits (else invariance is trivial)."""
    a = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[0, 14] = (b[0, 14] + 1) % 258
    with torch.no_grad():
        la = run_chunks(txl, a, [15, 5])
        lb = run_chunks(txl, b, [15, 5])
    assert (la[:, 15:] - lb[:, 15:]).abs().max() > 1e-3


def test_causality(txl):
    torch.manual_seed(0)
    a = torch.randint(0, 258, (1, 40))
    for j in (0, 7, 23, 39):
        b = a.clone()
        b[0, j] = (b[0, j] + 17) % 258
        with torch.no_grad():
            la, _ = txl(a)
            lb, _ = txl(b)
        assert torch.equal(la[:, :j], lb[:, :j]), f"changing token {j} changed an earlier logit"
        assert (la[:, j] - lb[:, j]).abs().max() > 0


def test_window_is_exactly_mem_len(txl):
    """In window mode, position t depends on tokens t-mem_len*n_layer .. t and nothing older."""
    L = txl.config.n_layer
    la, lb = logits_with_one_token_changed(txl, 60, 10, seed=3)
    reach = 10 + MEM * L
    assert (la[:, reach] - lb[:, reach]).abs().max() > 0
    assert torch.equal(la[:, reach + 1 :], lb[:, reach + 1 :])


def test_bounded_state_size(txl):
    def size_after(n):
        state = txl.new_state(1)
        tokens = torch.randint(0, 258, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():  # big chunks: in window mode chunking changes nothing
            for i in range(0, n, 500):
                _, state = txl(tokens[:, i : i + 500], state)
        assert int(state.n_tokens) == n
        blob = state.to_bytes()
        return len(blob) - int.from_bytes(blob[:8], "little")  # the payload (the header holds n)

    assert size_after(1_000) == size_after(20_000)


def test_stop_grad_between_segments():
    lm = tiny_txl(dropout=0.0).train()
    captured = []
    x = torch.randint(0, 258, (2, 16))

    # segment 1: keep a handle on its embedding output to see if gradient reaches it
    emb = lm.word_emb

    def keep(module, inputs, output):
        output.retain_grad()
        captured.append(output)

    hook = emb.register_forward_hook(keep)
    _, s1 = lm(x[:, :8])
    hook.remove()
    for t in s1.tensors.values():
        assert not t.requires_grad, "memory passed to the next segment must be detached"
    logits2, _ = lm(x[:, 8:], s1)
    logits2.sum().backward()
    assert captured[0].grad is None, "gradient of segment 2 leaked into segment 1"
    assert lm.layers[0].dec_attn.qkv_net.weight.grad is not None


def test_batching_streams_of_different_lengths(txl):
    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, 258, (1, n), generator=g) for n in (0, 3, 8, 21)]
    nxt = torch.randint(0, 258, (4, 6), generator=g)
    with torch.no_grad():
        alone, states = [], []
        for i, h in enumerate(histories):
            s = txl.new_state(1)
            if h.shape[1]:
                _, s = txl(h, s)
            states.append(s)
            logits, s_after = txl(nxt[i : i + 1], s)
            alone.append((logits, s_after))
        batched_logits, batched_state = txl(nxt, txl.stack_states(states))
    for i, (logits, _) in enumerate(alone):
        assert (batched_logits[i] - logits[0]).abs().max() <= 1e-5
    for i, part in enumerate(txl.split_state(batched_state)):
        assert part["mem"].shape == alone[i][1]["mem"].shape
        assert (part["mem"] - alone[i][1]["mem"]).abs().max() <= 1e-5
        assert int(part.n_tokens) == int(alone[i][1].n_tokens)


def test_segment_mode_depends_on_segmentation_as_the_paper():
    lm = tiny_txl(attention="segment")
    tokens = torch.randint(0, 258, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = run_chunks(lm, tokens, [8, 8, 8, 8])
        again = run_chunks(lm, tokens, [8, 8, 8, 8])
        other = run_chunks(lm, tokens, [4, 12, 16])
    assert torch.equal(whole, again)
    assert (whole - other).abs().max() > 1e-4


def test_rel_shift_aligns_distances():
    B, H, T, M = 1, 2, 5, 7
    K = M + T
    # x[..., i, c] = distance represented by column c, i.e. K-1-c
    x = (K - 1 - torch.arange(K)).float().expand(B, H, T, K).clone()
    y = rel_shift(x)
    i = torch.arange(T)[:, None]
    j = torch.arange(K)[None, :]
    dist = M + i - j
    valid = dist >= 0
    assert torch.equal(y[0, 0][valid], dist[valid].float())


def test_dropout_only_in_training():
    lm = tiny_txl(dropout=0.5)
    x = torch.randint(0, 258, (1, 10))
    with torch.no_grad():
        assert torch.equal(lm(x)[0], lm(x)[0])
        lm.train()
        assert not torch.equal(lm(x)[0], lm(x)[0])


def test_clamp_len_limits_distances():
    lm = tiny_txl(clamp_len=2, attention="segment")
    x = torch.randint(0, 258, (1, 12))
    with torch.no_grad():
        logits, _ = lm(x)
    assert torch.isfinite(logits).all()
