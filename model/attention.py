"""Attention over a stream's stored keys and values, as a bounded recurrent state: S
attention sinks and a sliding window of W positions (StreamingLLM, Xiao et al., ICLR 2024),
or, with S = 0 and W a configured bound, every position so far (exact attention, refused past
the bound by its family). The LLaMA family (`model/llama.py`) and the hybrids' attention
layers (`model/hybrid.py`) share it: positions and masks (`span`), the attention itself
(`attend`), the sinks a chunk leaves (`next_sinks`) and the layout of the state's time axes
(`kv_axes`).

What a query sees. The query at absolute position p attends to
  * the sinks: the positions j < S, whose keys and values a stream keeps for ever, and
  * the window: the positions j with max(S, p - W) <= j <= p, itself and the W before it.
Within the first S + W + 1 positions that is every j <= p: the original model, exactly.

Positions, StreamingLLM's way: positions within the cache. A RoPE score depends only on the
distance between the query and the key. A window key is seen at its true distance p - j (at
most W); a sink at distance min(p, S + W) - j, as if the query stood right after the cache
[sinks; window]. Keys are stored rotated at their absolute position j; the query is rotated
twice, at p for the window and at min(p, S + W) for the sinks. Angles are computed in
float64 from int64 positions (`model/rotary.py`). A rotation may cover only the first
dimensions of each head (partial RoPE, Qwen3-Next's), or none (NoPE, Granite-4.0-H's).

Rows shorter than the batch's longest are left-padded; a key's position (negative for
padding) decides every mask. Nothing here knows a family's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .family import TimeAxis
from .rotary import Rope, pair_of, rope_angles, rotate, rotate_twice

Pair = tuple[torch.Tensor, torch.Tensor]  # keys and values
# appends a layer's new keys and values to its window, returns all of them (B, M+T, kvh*hd)
KV = Callable[[torch.Tensor, torch.Tensor], Pair]


def kv_axes(layers: int, width: int, sinks: int, window: int) -> dict[str, TimeAxis]:
    """The state's time axes for `layers` attention layers of keys `width` wide: the window
    `k`, `v` (sliding) and the sinks `sink_k`, `sink_v` (filling, then kept)."""
    win = TimeAxis(layers, width, window)
    sink = TimeAxis(layers, width, sinks, fills=True)
    return {"k": win, "v": win, "sink_k": sink, "sink_v": sink}


# -- positions and masks ------------------------------------------------------------------
@dataclass
class Span:
    """What every layer of one forward shares: the rotations and which keys each query sees.

    cs       rotations at the chunk's absolute positions (B, T, 1, hd): its keys, and its
             queries as the window sees them
    cs_sink  the queries' rotations as the sinks see them (at min(p, S + W)), or None
    window   (B, 1, 1, T, M+T) 0 where the query sees the window key, -inf where not; None: all
    sink     (B, 1, 1, T, Ms+n_new) the same over the stored sinks then the chunk's first
             n_new rows (those that may be sinks), or None: all
    n_new    how many of the chunk's first rows may be sinks (0 once every row has S)
    sinks    whether the queries attend to sinks at all (S > 0 and some row holds or makes one)
    both     cs and cs_sink side by side (B, T, 2, 1, hd), for `rotate_twice`, or None
    """

    cs: Rope | None
    cs_sink: Rope | None
    window: torch.Tensor | None
    sink: torch.Tensor | None
    n_new: int
    sinks: bool
    both: Rope | None = None


def bias(ok: torch.Tensor) -> torch.Tensor:
    """(B, T, K) True where a query sees a key -> the additive mask (B, 1, 1, T, K)."""
    zero = torch.zeros((), device=ok.device)
    return torch.where(ok, zero, float("-inf"))[:, None, None]


def sink_positions(n: torch.Tensor, Ms: int, pos: torch.Tensor, n_new: int, S: int) -> torch.Tensor:
    """(B, Ms+n_new) the position of each sink candidate: row b's stored sinks are the
    positions 0 .. min(n_b, S)-1 in its last slots (the slots before them: padding, negative),
    then the chunk's first n_new positions."""
    stored = n.clamp(max=S)[:, None] - Ms + torch.arange(Ms, device=n.device)
    return torch.cat([stored, pos[:, :n_new]], 1)


# -- attention ------------------------------------------------------------------------------
def _heads(x: torch.Tensor, kvh: int) -> torch.Tensor:
    """Keys or values (B, K, kvh*hd) -> a view (B, kvh, K, hd)."""
    B, K, D = x.shape
    return x.view(B, K, kvh, D // kvh).transpose(1, 2)


def _grouped(q: torch.Tensor, kvh: int, hd: int) -> torch.Tensor:
    """Queries (B, T, H*hd) -> (B, kvh, g*T, hd), the g query heads of each key/value head
    (HF's repeat_kv order: query head h reads key/value head h // g) in one matrix."""
    B, T, D = q.shape
    g = D // (kvh * hd)
    return q.view(B, T, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * T, hd)


def attend(
    q: torch.Tensor,  # (B, T, H*hd) rotated for the window, scaled by hd^-1/2
    q_sink: torch.Tensor | None,  # the same rotated for the sinks (None: as q, unrotated)
    window: Pair,  # (B, M+T, kvh*hd) the window's keys and values
    sinks: Pair,  # (B, Ms+n_new, kvh*hd) the sink candidates'
    span: Span,
    kvh: int,
) -> torch.Tensor:
    """softmax over [sinks; window] of the scores plus the masks, times the values ->
    (B, T, H*hd). The two parts' queries differ (their rotations), and two layouts serve:
    a chunk (T > 1) scores both parts in one product (`_joined`); one query per stream (a
    decode step) scores them apart, reading the cached keys and values where they lie
    (`_apart`), since joining them would copy the whole window every step; one stream's
    step does so on 3-D views, in fewer calls (`_one_query`)."""
    B, T, D = q.shape
    hd = window[0].shape[-1] // kvh
    Ks = sinks[0].shape[1] if span.sinks else 0
    if B == T == 1:
        return _one_query(q, q if q_sink is None else q_sink, window, sinks if Ks else None, span, kvh)
    qg = _grouped(q, kvh, hd)  # (B, kvh, g*T, hd)
    if Ks:
        qs, sk = _grouped(q if q_sink is None else q_sink, kvh, hd), (_heads(sinks[0], kvh), _heads(sinks[1], kvh))
        join = _joined if T > 1 else _apart
        out = join(qg, qs, (_heads(window[0], kvh), _heads(window[1], kvh)), sk, (span.sink, span.window), T)
    else:
        out = _apart(qg, None, (_heads(window[0], kvh), _heads(window[1], kvh)), None, (None, span.window), T)
    g = D // (kvh * hd)
    return out.view(B, kvh, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, D)


Masks = tuple[torch.Tensor | None, torch.Tensor | None]  # the sinks', the window's (B, 1, 1, T, K)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, T: int) -> torch.Tensor:
    """scores (B, kvh, g*T, K) plus an additive mask (B, 1, 1, T, K), in place."""
    if mask is None:
        return scores
    B, kvh, gT, K = scores.shape
    return scores.view(B, kvh, gT // T, T, K).add_(mask).view(B, kvh, gT, K)


def _in_place(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, (B, kvh, X, Y) @ (B, kvh, Y, Z) -> (B, kvh, X, Z), reading b where it lies.
    `torch.matmul` folds (B, kvh) into one batch axis, and where b's streams are not kvh
    heads apart in memory (a window in its arena: [B, L, capacity, kvh*hd], so one stream's
    layer is L*capacity rows from the next's) that fold copies the whole of b: a decode step
    of a batch would copy every layer's window twice. One product per key/value head takes
    the streams as its batch axis at any stride, and copies nothing."""
    B, H = b.shape[:2]
    if B == 1 or H == 1 or b.stride(0) == H * b.stride(1):
        return _product(a, b)
    return torch.stack([torch.bmm(a[:, h], b[:, h]) for h in range(H)], 1)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, (B, H, X, Y) @ (B, H, Y, Z); one stream's as one `bmm` over its heads, in half
    the calls of matmul's broadcasting (a decode step makes three such products a layer)."""
    if a.shape[0] == 1:
        return torch.bmm(a[0], b[0]).unsqueeze(0)
    return a @ b


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """The softmax over keys in float32 at least (bf16 scores gain it; float64 keeps its own,
    so a float64 test sees no float32 rounding it did not ask for)."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1)


def _sink_scores(qs: torch.Tensor, sk: Pair, masks: Masks, T: int) -> torch.Tensor:
    """The sinks' scores, each sink met by its own rotation of the query, a batch's padding
    and unfilled sink slots masked -> (B, kvh, g*T, Ks). Both ways of scoring a step
    (`_apart`, `_apart_fused`) take them from here."""
    return _masked(_product(qs, sk[0].transpose(-1, -2)), masks[0], T)


def _apart(
    qg: torch.Tensor, qs: torch.Tensor | None, win: Pair, sk: Pair | None, masks: Masks, T: int
) -> torch.Tensor:
    """Each part scored by its own product, one softmax over both -> (B, kvh, g*T, hd)."""
    if _fused(qg, win, T):
        return _apart_fused(qg, qs, win, sk, masks)
    scores = _masked(_in_place(qg, win[0].transpose(-1, -2)), masks[1], T)  # (B, kvh, g*T, Kw)
    Ks = 0
    if qs is not None and sk is not None:
        Ks = sk[0].shape[2]
        scores = torch.cat([_sink_scores(qs, sk, masks, T), scores], -1)
    p = _softmax(scores).to(win[1].dtype)
    out = _in_place(p[..., Ks:], win[1])
    if sk is not None and Ks:
        B, kvh, gT, hd = out.shape
        out = torch.baddbmm(
            out.view(B * kvh, gT, hd), p[..., :Ks].reshape(B * kvh, gT, Ks), sk[1].reshape(B * kvh, Ks, hd)
        )
    return out.view(p.shape[0], p.shape[1], -1, win[1].shape[-1])


def _one_query(
    q: torch.Tensor, q_sink: torch.Tensor, window: Pair, sinks: Pair | None, span: Span, kvh: int
) -> torch.Tensor:
    """`_apart` for one query of one stream (a batch-1 decode step) -> (1, 1, H*hd): each
    product one `bmm` over the key/value heads, on 3-D views of the keys and values where
    they lie. The same products and softmax as `_apart`'s, to the bit, in fewer calls: the
    general layout's views, permutes and broadcasting took more of smollm2's step than its
    three products (bench/one_stream.py, docs/BENCHMARKS.md "One stream's decode step")."""
    D = q.shape[-1]
    hd = window[0].shape[-1] // kvh

    def heads(x: torch.Tensor) -> torch.Tensor:  # (1, K, kvh*hd) -> (kvh, K, hd)
        return x.view(-1, kvh, hd).transpose(0, 1)

    scores = torch.bmm(q.view(kvh, -1, hd), heads(window[0]).transpose(1, 2))  # (kvh, g, Kw)
    if span.window is not None:
        scores.add_(span.window.view(1, 1, -1))
    Ks = 0
    if sinks is not None:
        sk = (heads(sinks[0])[None], heads(sinks[1])[None])
        Ks = sk[0].shape[2]
        own = _sink_scores(q_sink.view(1, kvh, -1, hd), sk, (span.sink, None), 1)[0]  # (kvh, g, Ks)
        scores = torch.cat([own, scores], -1)
    p = _softmax(scores).to(window[1].dtype)
    out = torch.bmm(p[..., Ks:], heads(window[1]))
    if Ks:
        out = torch.baddbmm(out, p[..., :Ks], sk[1][0])
    return out.view(1, 1, D)


def _fused(qg: torch.Tensor, win: Pair, T: int) -> bool:
    """Whether a decode step's window goes through torch's fused CPU attention kernel: one
    query per row, more than one row, eager, on the CPU, in one floating dtype. A step of
    many rows reads every row's window: the fused kernel (scores, softmax and values in one
    pass, accumulated in fp32) reads each key and value once, where the two products read
    them apart: 16 rows of smollm2's shape, one thread, the 30 layers 65 ms against 91 at
    513 keys, 125 against 166 at 1,024; the whole int4 step 1.17x (`bench/attention.py`,
    docs/BENCHMARKS.md). One row's step is the calls between kernels, and the merge's few
    calls cost more than the kernel saves there (6.3 ms against 4.8), so one row keeps the
    products (`_one_query`); a graph being compiled keeps them too (inductor fuses them itself)."""
    return (
        T == 1
        and qg.shape[0] > 1
        and qg.device.type == "cpu"
        and qg.dtype in (torch.float32, torch.bfloat16)
        and qg.dtype == win[0].dtype == win[1].dtype
        and not torch.compiler.is_compiling()
    )


def _apart_fused(
    qg: torch.Tensor, qs: torch.Tensor | None, win: Pair, sk: Pair | None, masks: Masks
) -> torch.Tensor:
    """`_apart` for one query per row, the window through the fused kernel, which gives its
    log-sum-exp too: the sinks' scores (their own query) join the window's by log-sum-exp,
    the softmax over both that `_apart` takes -> (B, kvh, g, hd)."""
    mask = masks[1]
    if mask is not None:  # (B, 1, 1, 1, K) -> (B, 1, 1, K), for the g rows of every head
        mask = mask.view(mask.shape[0], 1, 1, mask.shape[-1]).to(qg.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, win[0], win[1], attn_mask=mask, scale=1.0
    )
    if qs is None or sk is None or sk[0].shape[2] == 0:
        return out
    if mask is not None:  # a row that sees no window key (all its keys sinks) gets lse 0: -inf
        lse = lse.masked_fill(mask.amax(-1) == float("-inf"), float("-inf"))
    scores = _sink_scores(qs, sk, masks, 1).float()  # (B, kvh, g, Ks)
    both = torch.logaddexp(lse, scores.logsumexp(-1))  # the log of the softmax's denominator
    out = out.float().mul_((lse - both).exp_().unsqueeze(-1))
    return out.add_((scores - both.unsqueeze(-1)).exp_() @ sk[1].float()).to(win[1].dtype)


def _joined(qg: torch.Tensor, qs: torch.Tensor, win: Pair, sk: Pair, masks: Masks, T: int) -> torch.Tensor:
    """Both parts in one product: the head dimension doubled, a query [q; q_sink], a sink's
    key [0; k], a window key [k; 0], so each part meets its own rotation of the query and
    the scores come out joined (no copy of them); the keys are copied instead, which a
    chunk's many queries repay -> (B, kvh, g*T, hd)."""
    ks, kw = sk[0], win[0]
    keys = torch.cat(
        [torch.cat([torch.zeros_like(ks), ks], -1), torch.cat([kw, torch.zeros_like(kw)], -1)], 2
    )
    scores = torch.cat([qg, qs], -1) @ keys.transpose(-1, -2)  # (B, kvh, g*T, Ks+Kw)
    if masks[0] is not None or masks[1] is not None:
        B, Ks, Kw = kw.shape[0], ks.shape[2], kw.shape[2]
        sink = masks[0] if masks[0] is not None else scores.new_zeros(B, 1, 1, T, Ks)
        wind = masks[1] if masks[1] is not None else scores.new_zeros(B, 1, 1, T, Kw)
        scores = _masked(scores, torch.cat([sink, wind], -1), T)
    p = _softmax(scores).to(win[1].dtype)
    return p @ torch.cat([sk[1], win[1]], 2)



def span(
    n: torch.Tensor, T: int, M: int, Ms: int, sinks: int, window: int, rope: tuple[int, float] | None,
    dtype: torch.dtype,
) -> Span:
    """The rotations and masks of a chunk of T tokens after `n` (B,) consumed, over M
    window rows and Ms stored sinks (left-padded rows included), for S = `sinks` and W =
    `window`; `rope` is (rotated dimensions per head, base), or None (no positions)."""
    S, W, dev = sinks, window, n.device
    # one host read (eager only): how many chunk rows may be sinks, and which masks can
    # be left out; a graph being compiled reads nothing from the host and masks always
    n_min = 0 if torch.compiler.is_compiling() else int(n.min())
    n_new = min(T, max(0, S - n_min))
    pos = n[:, None] + torch.arange(T, device=dev)  # (B, T) absolute positions

    def angles(p: torch.Tensor) -> Rope | None:
        return None if rope is None else rope_angles(p, rope[0], rope[1], dtype)

    mask = None
    if T > 1 or n_min < S + M:  # else every row's window keys are all in reach, no sink among them
        kpos = n[:, None] - M + torch.arange(M + T, device=dev)  # (B, M+T); padding: < 0
        dist = pos[:, :, None] - kpos[:, None]  # (B, T, M+T)
        mask = bias((kpos[:, None] >= S) & (dist >= 0) & (dist <= W))
    if S == 0 or Ms + n_new == 0:
        return Span(angles(pos), None, mask, None, 0, False)
    sink = None
    if n_new or n_min < Ms:
        spos = sink_positions(n, Ms, pos, n_new, S)[:, None]  # (B, 1, Ms+n_new)
        sink = bias((spos >= 0) & (spos < S) & (spos <= pos[:, :, None]))
    cs, cs_sink = angles(pos), angles(pos.clamp(max=S + W))
    both = None if cs is None or cs_sink is None else pair_of(cs, cs_sink)
    return Span(cs, cs_sink, mask, sink, n_new, True, both)


def next_sinks(old: Pair, fresh: list[Pair], n: torch.Tensor, S: int, T: int) -> Pair:
    """The sinks (B, L, Ms', D) after a chunk of T tokens: each row's first min(n_b + T, S)
    positions, left-padded (with zeros) to the longest, from its stored sinks `old` and the
    chunk's first rows (`fresh`, per layer)."""
    old_k, old_v = old
    n_new = fresh[0][0].shape[1] if fresh else 0
    if n_new == 0:  # every row holds its S sinks already
        return old_k, old_v
    B, L, Ms, D = old_k.shape
    Ms_after = min(Ms + T, S)  # a row still filling had the most sinks, or one has them all
    # slot r of row b holds position q = r - (Ms_after - k_b), k_b = min(n_b + T, S)
    q = (
        torch.arange(Ms_after, device=n.device) - (Ms_after - (n + T).clamp(max=S))[:, None]
    )  # (B, Ms_after)
    stored = n.clamp(max=S)[:, None]
    idx = torch.where(q < stored, Ms - stored + q, Ms + q - n[:, None]).clamp(min=0)
    idx = idx[:, None, :, None].expand(B, L, Ms_after, D)
    real = (q >= 0)[:, None, :, None]
    out = []
    for prev, part in ((old_k, 0), (old_v, 1)):
        cand = torch.cat(
            [prev, torch.stack([f[part] for f in fresh], 1).to(prev.dtype)], 2
        )  # (B, L, Ms+n_new, D)
        out.append(torch.where(real, cand.gather(2, idx), torch.zeros((), dtype=prev.dtype)))
    return out[0], out[1]


def attend_stream(
    q: torch.Tensor,  # (B, T, H*hd) scaled, not yet rotated
    k: torch.Tensor,  # (B, T, kvh*hd) not yet rotated
    v: torch.Tensor,  # (B, T, kvh*hd)
    span: Span,
    kv: KV,
    sinks: Pair,  # this layer's stored sinks (B, Ms, kvh*hd)
    heads: tuple[int, int],  # (H, kvh)
) -> tuple[torch.Tensor, Pair]:
    """One attention layer's chunk over its stream: the keys rotated at their absolute
    positions and appended to the window (`kv`), the queries rotated for the window and for
    the sinks -> the attention's output (B, T, H*hd), and the chunk's first `span.n_new` keys
    and values (the rows that may become sinks, `next_sinks`)."""
    H, kvh = heads
    T = k.shape[1]
    # the keys rotated at their absolute positions, appended as the cache keeps them (at the
    # state's precision): the chunk attends to, and its sinks are, the stored rows
    window = kv(rotate(k, span.cs, kvh), v)
    n = window[0].shape[1] - T  # the chunk's first row
    fresh = (window[0][:, n : n + span.n_new], window[1][:, n : n + span.n_new])
    if not span.sinks:
        return attend(rotate(q, span.cs, H), None, window, sinks, span, kvh), fresh
    if span.n_new:  # (else every row holds its sinks: nothing to join)
        sinks = (torch.cat([sinks[0], fresh[0]], 1), torch.cat([sinks[1], fresh[1]], 1))
    if span.both is not None and span.both[0].shape[-1] * H == q.shape[-1]:  # (every dimension turns)
        q, q_sink = rotate_twice(q, span.both, H)
    else:
        q, q_sink = rotate(q, span.cs, H), rotate(q, span.cs_sink, H)
    return attend(q, q_sink, window, sinks, span, kvh), fresh
