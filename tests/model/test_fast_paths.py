"""The inference fast paths against straightforward references (issue 14).

* Transformer-XL's decode step (`RelPartialLearnableMultiHeadAttn.step`: no relative shift,
  the position table sliced, one stream's cache read in place from a time-major arena)
  against training-mode forward, which projects the memory and W_{k,R} R afresh and
  shifts relative scores as the paper does.
* RLT's chunk (the encoder over the chunk at once, the recurrent decoder stepping through
  it) against `reference_rlt` below: the report's equations one token at a time, with
  nn.RMSNorm, rotate-half RoPE by concatenation and an explicit softmax.
* The CPU weight layout (`model.family.lay_out_weights`) changes no value a checkpoint
  or a fingerprint sees.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import model

from .conftest import tiny_txl
from .test_rlt import tiny_rlt

ATOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


# -- Transformer-XL -----------------------------------------------------------------------
def _txl_reference(lm, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of training-mode forward (no cache, no tables), dropout off, in one call."""
    lm.train()
    try:
        with torch.no_grad():
            return lm(tokens, lm.new_state(tokens.shape[0]))[0]
    finally:
        lm.eval()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"pre_lnorm": True, "final_norm": True}, {"untie_r": False}, {"clamp_len": 3}],
)
def test_txl_decode_steps_equal_training_forward(overrides):
    lm = tiny_txl(seed=2, **overrides)
    tokens = torch.randint(0, 258, (1, 30), generator=torch.Generator().manual_seed(3))
    want = _txl_reference(lm, tokens)
    with torch.no_grad():
        state, got = lm.new_state(1), []
        for t in range(tokens.shape[1]):  # one stream, one token a step: the served step path
            logits, state = lm(tokens[:, t : t + 1], state, model.IN_PLACE)
            got.append(logits)
        assert state["k"].stride(2) == 1  # a single stream's cache lies along time
        chunked, _ = lm(tokens, lm.new_state(1))
    _close(torch.cat(got, 1), want)
    _close(chunked, want)


def test_txl_batched_decode_steps_equal_each_stream_alone():
    """Streams of different lengths in one batch: left-padded memories, the padding masked."""
    lm = tiny_txl(seed=4)
    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, 258, (1, n), generator=g) for n in (0, 3, 11)]
    steps = torch.randint(0, 258, (3, 12), generator=g)
    with torch.no_grad():
        states = [lm(h, lm.new_state(1))[1] if h.shape[1] else lm.new_state(1) for h in histories]
        batch, got = lm.stack_states(states), []
        for t in range(steps.shape[1]):
            logits, batch = lm(steps[:, t : t + 1], batch)
            got.append(logits)
    for i, h in enumerate(histories):
        want = _txl_reference(lm, torch.cat([h, steps[i : i + 1]], 1))[:, h.shape[1] :]
        _close(torch.cat(got, 1)[i : i + 1], want)


def test_txl_segment_mode_steps_equal_training_forward():
    """Segment mode depends on the chunking: compare the same chunking, one token a call."""
    for overrides in ({"attention": "segment"}, {"attention": "segment", "same_length": True}):
        lm = tiny_txl(seed=6, **overrides)
        tokens = torch.randint(0, 258, (2, 20), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            got, state = [], lm.new_state(2)
            for t in range(tokens.shape[1]):
                logits, state = lm(tokens[:, t : t + 1], state)
                got.append(logits)
            lm.train()
            want, ref = [], lm.new_state(2)
            for t in range(tokens.shape[1]):
                logits, ref = lm(tokens[:, t : t + 1], ref)
                want.append(logits)
            lm.eval()
        _close(torch.cat(got, 1), torch.cat(want, 1))


# -- RLT ----------------------------------------------------------------------------------
def _rope(x: torch.Tensor, pos: int, n_head: int, base: float) -> torch.Tensor:
    """Rotate-half RoPE of one position's x (B, n_head*hd), written out by concatenation."""
    B, D = x.shape
    hd = D // n_head
    inv_freq = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv_freq
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x.view(B, n_head, hd).chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).view(B, D)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_head: int) -> torch.Tensor:
    """One query (B, D) over keys and values (B, K, D), an explicit softmax per head."""
    B, K, D = k.shape
    hd = D // n_head
    qh = q.view(B, n_head, 1, hd)
    kh, vh = k.view(B, K, n_head, hd).transpose(1, 2), v.view(B, K, n_head, hd).transpose(1, 2)
    p = torch.softmax(qh @ kh.transpose(-1, -2) / hd**0.5, -1)
    return (p @ vh).reshape(B, D)


def reference_rlt(lm, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The report's equations, one token at a time, streams starting empty: logits (B, T, V)
    and the caches the state keeps (the last C-1 or W-1 entries, s)."""
    cfg = lm.config
    C, W, H, G = cfg.max_context, cfg.window, cfg.n_head, cfg.memory_groups
    B, T = tokens.shape
    enc = [([], []) for _ in lm.encoder]
    swa = [([], []) for _ in lm.decoder]
    mem = [([], []) for _ in range(G)]
    s = lm.s_star.expand(B, -1)
    out = []
    for t in range(T):
        x = lm.tok_emb(tokens[:, t])  # (B, d)
        for blk, (ks, vs) in zip(lm.encoder, enc, strict=True):
            q, k, v = blk.attn.qkv(blk.norm1(x)).chunk(3, -1)
            ks.append(_rope(k, t, H, cfg.rope_base))
            vs.append(v)
            a = _attend(_rope(q, t, H, cfg.rope_base), torch.stack(ks[-C:], 1), torch.stack(vs[-C:], 1), H)
            x = x + blk.attn.proj(a)
            x = x + blk.mlp.proj(F.gelu(blk.mlp.fc(blk.norm2(x))))
        e, h = x, lm.memory.norm(x)
        mk, mv = _rope(lm.memory.k(h), t, G * H, cfg.rope_base).chunk(G, -1), lm.memory.v(h).chunk(G, -1)
        for g in range(G):
            mem[g][0].append(mk[g])
            mem[g][1].append(mv[g])
        if lm.merge is None:
            x = e
        else:
            r = lm.merge.norm(s)
            x = e + lm.merge.alpha * torch.sigmoid(lm.merge.gate(torch.cat([e, r], -1))) * lm.merge.W_s(r)
        for i, (blk, (ks, vs)) in enumerate(zip(lm.decoder, swa, strict=True)):
            q, k, v = blk.attn.qkv(blk.norm1(x)).chunk(3, -1)
            ks.append(_rope(k, t, H, cfg.rope_base))
            vs.append(v)
            a = _attend(_rope(q, t, H, cfg.rope_base), torch.stack(ks[-W:], 1), torch.stack(vs[-W:], 1), H)
            x = x + blk.attn.proj(a)
            q = _rope(blk.cross.q(blk.norm2(x)), t, H, cfg.rope_base)
            mks, mvs = mem[i % G]
            x = x + blk.cross.proj(_attend(q, torch.stack(mks[-C:], 1), torch.stack(mvs[-C:], 1), H))
            x = x + blk.mlp.proj(F.gelu(blk.mlp.fc(blk.norm3(x))))
        s = x
        out.append(lm.head(lm.norm_out(s)))

    def keep(rows: list[list[torch.Tensor]], n: int) -> torch.Tensor:  # [B, L, n, d]
        return torch.stack([torch.stack(r[len(r) - n :], 1) for r in rows], 1)

    tensors = {"s": s}
    for name, caches, bound in (("enc", enc, C - 1), ("swa", swa, W - 1), ("mem", mem, C - 1)):
        tensors[name + "_k"] = keep([k for k, _ in caches], min(T, bound))
        tensors[name + "_v"] = keep([v for _, v in caches], min(T, bound))
    return torch.stack(out, 1), tensors


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("chunks", [[23], [1] * 23, [5, 1, 9, 8]])
def test_rlt_chunks_equal_the_token_by_token_reference(feedback, chunks):
    """The encoder over a chunk at once (sliding-window attention over the chunk plus the
    cached entries, memory entries for the whole chunk), the decoder stepping through it:
    logits and every state tensor as the reference computes them."""
    lm = tiny_rlt(seed=3, feedback=feedback)  # C = 8, W = 3: 23 tokens slide both windows
    tokens = torch.randint(0, 258, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, ref = reference_rlt(lm, tokens)
        state, got, i = lm.new_state(2), [], 0
        for n in chunks:
            logits, state = lm(tokens[:, i : i + n], state)
            got.append(logits)
            i += n
    _close(torch.cat(got, 1), want)
    for name, t in ref.items():
        _close(state[name], t)


def test_rlt_batched_chunks_with_padding_equal_each_stream_alone():
    lm = tiny_rlt(seed=5)
    g = torch.Generator().manual_seed(6)
    histories = [torch.randint(0, 258, (1, n), generator=g) for n in (1, 4, 13)]
    cont = torch.randint(0, 258, (3, 10), generator=g)
    with torch.no_grad():
        states = [lm(h, lm.new_state(1))[1] for h in histories]
        batch = lm.stack_states(states)
        logits_a, batch = lm(cont[:, :6], batch)
        logits_b, batch = lm(cont[:, 6:7], batch)
        logits_c, batch = lm(cont[:, 7:], batch)
        got = torch.cat([logits_a, logits_b, logits_c], 1)
        for i, h in enumerate(histories):
            want, ref = reference_rlt(lm, torch.cat([h, cont[i : i + 1]], 1))
            _close(got[i : i + 1], want[:, h.shape[1] :])
            alone = lm.split_state(batch)[i]
            for name, t in ref.items():
                _close(alone[name], t)


@pytest.mark.parametrize(
    # the tiny RLT (a context of 8, chunks of 5: 100 tokens cross both many times) in the
    # default suite; the shipped one (minutes of single-token steps on 2 cores) in the slow one
    ("name", "n"),
    [("tiny-rlt", 100), pytest.param("shakespeare-rlt", 300, marks=pytest.mark.slow)],
)
def test_rlt_prefill_equals_decoding_token_by_token(name, n):
    lm = tiny_rlt(seed=6) if name == "tiny-rlt" else model.load(name, device="cpu")
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        whole, s_whole = lm.consume(ids, lm.new_state(1))
        one, s_one = lm.new_state(1), []
        for t in range(ids.shape[1]):
            lp, one = lm.prefill(ids[:, t : t + 1], one, logprobs=True)
            s_one.append(lp)
    _close(whole[:, 1:], torch.cat(s_one, 1)[:, 1:])
    for key in lm.persistent:
        _close(s_whole[key].float(), one[key].float())


# -- the CPU weight layout ----------------------------------------------------------------
def test_weight_layout_changes_no_saved_value(tmp_path):
    lm = tiny_txl(seed=9)  # eval(): tall linear weights are stored transposed
    tall = lm.layers[0].pos_ff.CoreNet[0].weight
    assert not tall.is_contiguous() and tall.t().is_contiguous()
    assert all(t.is_contiguous() for t in lm.state_dict().values())
    assert model.fingerprint(lm) == lm.fingerprint
    model.save(lm, tmp_path / "ck")
    again = model.load(tmp_path / "ck", device="cpu")
    assert again.fingerprint == lm.fingerprint
    x = torch.randint(0, 258, (1, 9))
    with torch.no_grad():
        _close(again(x)[0], lm(x)[0], atol=1e-6)


# -- a compiled step ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    # the tiny models in the default suite; the shipped ones (minutes to compile on 2 cores) in the slow one
    [
        "tiny-txl",
        "tiny-rlt",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("shakespeare", "shakespeare-rlt")),
    ],
)
def test_a_compiled_step_equals_the_eager_one(name):
    """`RECUR_COMPILE` changes speed, never results: the fast paths' host-side shortcuts
    (cached masks, a padding check) step aside under torch.compile, which would otherwise
    break the graph (and did: inductor then emitted code naming an undefined symbol)."""
    tiny = {"tiny-txl": tiny_txl, "tiny-rlt": tiny_rlt}
    lm = tiny[name]() if name in tiny else model.load(name, device="cpu")
    with torch.no_grad():
        _, state = lm.consume([1, 65, 66, 67] * 5, lm.new_state(1))
        step = torch.compile(lm.forward, dynamic=True)  # (functional, as the engine compiles it)
        tok = torch.zeros(1, 1, dtype=torch.long)
        eager = compiled = state
        for _ in range(8):
            le, eager = lm(tok, eager)
            lc, compiled = step(tok, compiled)
            _close(lc, le, atol=1e-4)
            tok = le[:, -1:].argmax(-1)


# -- the library's default (issue 42: `lm(tokens, state)` is the fast path) --------------------
@pytest.mark.parametrize("family", ["transformer-xl", "llama"])
def test_the_default_forward_grows_in_place_where_nothing_tracks_a_gradient(tmp_path, family):
    """A model as `model.load` returns it tracks no gradient, so `lm(tokens, state)` with no
    `how` and no `torch.no_grad` takes the in-place path (`model.family.untracked`), with the
    results of the functional one, also when one state is extended twice (a fork). A model
    whose parameters track gradients, with gradients on, still runs functionally (the
    state it returns carries the graph)."""
    from model.family import untracked

    from .test_llama import TINY as TINY_LLAMA

    txl = dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16, tgt_len=8)
    model.init(tmp_path / "m", family=family, seed=0, **(TINY_LLAMA if family == "llama" else txl))
    lm = model.load(tmp_path / "m", device="cpu")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    start = lm.consume(ids[:, :8], lm.new_state(2))[1]
    assert untracked(lm, start)
    for _ in range(2):  # (the second extends the same state again)
        got, st = lm(ids[:, 8:], start)
        with torch.no_grad():
            want, st_f = lm(ids[:, 8:], start, model.FUNCTIONAL)
        _close(got, want)
        for name in lm.persistent:
            _close(st[name].float(), st_f[name].float())
    assert not got.requires_grad
    lm.requires_grad_(True)  # (to fine-tune it)
    assert not untracked(lm, start)
    logits, _ = lm(ids[:, 8:], start)
    assert logits.requires_grad


# -- a prefill without log-probs (issue 42: the head over the last position only) ---------------
def _tiny(family: str) -> model.LanguageModel:
    from .conftest import tiny_ssm
    from .test_hybrid import tiny as tiny_hybrid
    from .test_llama import tiny as tiny_llama

    if family in ("mamba", "mamba2"):
        return tiny_ssm(family)
    if family.endswith("-hybrid"):
        return tiny_hybrid(family, "bounded")
    return {"transformer-xl": tiny_txl, "rlt": tiny_rlt, "llama": tiny_llama}[family]()


@pytest.mark.parametrize(
    "family", ["transformer-xl", "rlt", "mamba", "mamba2", "llama", "gdn-hybrid", "mamba2-hybrid"]
)
def test_a_prefill_without_logprobs_runs_the_head_over_its_last_position_alone(family):
    """`prefill` without log-probs asks its forward for the last position's logits only
    (`Execution.last_logits`), and every family's forward then returns [B, 1, V]: the last
    position's logits of the full forward, the same state to the bit, and the same
    `next_logits`. A prefill with log-probs still gets every position's."""
    lm = _tiny(family)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    asked: list[bool] = []
    advance = lm.advance

    def spying(tokens, state, how):
        asked.append(how.last_logits)
        return advance(tokens, state, how)

    with torch.no_grad():
        start = lm.prefill(ids[:, :3], lm.new_state(2), True)[1]
        lm.advance = spying
        try:
            _, quiet = lm.prefill(ids[:, 3:], start)
            lps, loud = lm.prefill(ids[:, 3:], start, True)
        finally:
            del lm.advance
        full, st_full = lm(ids[:, 3:], start, model.IN_PLACE)
        last, st_last = lm(ids[:, 3:], start, dataclasses.replace(model.IN_PLACE, last_logits=True))
    assert asked == [True, False]
    assert lps is not None and lps.shape == (2, 4)
    assert full.shape[1] == 4 and last.shape == (2, 1, full.shape[2])
    _close(last[:, 0], full[:, -1])
    for name in lm.persistent:
        assert torch.equal(st_last[name], st_full[name]), name
        assert torch.equal(quiet[name], loud[name]), name
    _close(lm.next_logits(quiet), lm.next_logits(loud))
    _close(lm.next_logits(st_last), full[:, -1])
