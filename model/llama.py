"""Decoder-only LLaMA-architecture transformers (LLaMA, Mistral, SmolLM2, ...) served as a
bounded recurrent state: S attention sinks and a sliding window of W positions
(StreamingLLM, Xiao et al., ICLR 2024).

Read top to bottom: config, positions and masks, attention, blocks, the model.

The architecture (LLaMA, Touvron et al., 2023): pre-norm blocks
    x = x + Attn(RMSNorm(x)),   x = x + MLP(RMSNorm(x)),   logits = head(RMSNorm(x))
with rotary position embeddings (RoPE, Su et al., 2021, rotate-half form as HF writes it) on
queries and keys; grouped-query attention (GQA: n_kv_head key/value heads, each shared by
n_head / n_kv_head query heads); the SwiGLU MLP down(silu(gate x) * up x); a head tied to
the token embedding or not. q, k and v are one matrix, and gate and up another, so a decode
step multiplies a layer's input twice, not five times.

What a query sees. The query at absolute position p attends to
  * the sinks: the positions j < S, whose keys and values a stream keeps for ever, and
  * the window: the positions j with max(S, p - W) <= j <= p, itself and the W before it.
Within the first S + W + 1 positions that is every j <= p: the original model, exactly.
StreamingLLM's finding is that models trained with full attention put a large share of
their attention on the first tokens whatever they hold; keeping those few keys lets the
window slide with the perplexity staying flat (`docs/MODEL_CARD.md` measures it here).
Mistral's sliding window is the case S = 0, W = sliding_window - 1 (`model/llama_hf.py`).

Positions, StreamingLLM's way: positions within the cache. A RoPE score depends only on the
distance between the query and the key. A window key is seen at its true distance p - j
(at most W); a sink at distance min(p, S + W) - j, as if the query stood right after the
cache [sinks; window]. So no distance ever exceeds S + W, and a session of any length stays
within the positions the model was trained on (`trained_context`). Keys are stored rotated
at their absolute position j; the query is rotated twice, at p for the window and at
min(p, S + W) for the sinks. Angles are computed in float64 from int64 positions
(`model.rlt.rope_angles`), so a key millions of tokens deep is rotated as exactly as the
tenth (no fp32 angle drift), and window scores see exact distances.

State, per stream (batch-first; everything persistent):
  k, v            [B, L, M, kvh*hd]   the window: the last M <= W positions' keys (rotated)
                                      and values (a sliding time axis)
  sink_k, sink_v  [B, L, Ms, kvh*hd]  the first Ms = min(n, S) positions' (a time axis that
                                      fills, then stops: `model.family.TimeAxis.fills`)
  last_hidden     [B, d]              the last position's output, for `next_logits`
  n_tokens        [B]                 the absolute position of the next token
and a cache, never stored: `next_logits` [B, V], the head's output at the last position,
which a forward computes anyway (the head is a fifth of a small model's weights: a decode
step that computed it twice would read them twice); a state loaded from bytes recomputes it.
Early in a stream a position can be both in the window and a sink: the window part masks
it. Rows shorter than the batch's longest are left-padded; a key's position (negative for
padding) decides every mask. The state is bounded, 2 L (S + W) kvh hd + d floats, whatever
the history, and a token's results never depend on where chunk or request boundaries fell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .family import Execution, LanguageModel, TimeAxis, init_weights
from .int8 import int8_linear
from .rlt import RMSNorm, Rope, apply_rope, rms_norm, rope_angles
from .state import State, StateError, kv_appender, unzip

Pair = tuple[torch.Tensor, torch.Tensor]  # keys and values

DEFAULT_SINKS = 4  # StreamingLLM's choice: four initial tokens hold the attention sink
DEFAULT_WINDOW = 1024  # the W a checkpoint gets unless it was trained with a window (docs/MODEL_CARD.md)
# appends a layer's new keys and values to its window, returns all of them (B, M+T, kvh*hd)
KV = Callable[[torch.Tensor, torch.Tensor], Pair]


@dataclass
class LlamaConfig:
    vocab_size: int = 258
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2  # GQA: each key/value head serves n_head / n_kv_head query heads
    head_dim: int = 16
    d_ff: int = 128  # the SwiGLU MLP's hidden width
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_weights: bool = True  # the head is the token embedding
    sinks: int = 4  # S: the first positions every query attends to
    window: int = 1024  # W: the previous positions every query attends to
    trained_context: int = 0  # positions the checkpoint was trained on (0: not known)
    tgt_len: int = 256  # the serving chunk size (results do not depend on it)

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.head_dim < 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError("n_head must be a multiple of n_kv_head")
        if self.sinks < 0 or self.window < 1 or self.tgt_len < 1:
            raise ValueError("sinks must be >= 0, window and tgt_len >= 1")
        if self.trained_context and self.sinks + self.window >= self.trained_context:
            raise ValueError(
                f"sinks + window = {self.sinks + self.window} must stay below the {self.trained_context} "
                "positions the model was trained on (the query's position within the cache is sinks + window)"
            )


def serving_span(trained_context: int, sliding_window: int | None = None) -> dict[str, int]:
    """The sinks and window a checkpoint is served with by default: a model trained with a
    sliding window of w positions (itself included: Mistral's) keeps exactly it, with no
    sinks; any other gets `DEFAULT_SINKS` and `DEFAULT_WINDOW`, within what it was trained on."""
    if sliding_window:
        return {"sinks": 0, "window": sliding_window - 1}
    window = (
        DEFAULT_WINDOW if not trained_context else min(DEFAULT_WINDOW, trained_context - DEFAULT_SINKS - 1)
    )
    return {"sinks": DEFAULT_SINKS, "window": window}


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
    """

    cs: Rope
    cs_sink: Rope | None
    window: torch.Tensor | None
    sink: torch.Tensor | None
    n_new: int


def _bias(ok: torch.Tensor) -> torch.Tensor:
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
    q_sink: torch.Tensor | None,  # the same rotated for the sinks (None: no sink part)
    window: Pair,  # (B, M+T, kvh*hd) the window's keys and values
    sinks: Pair,  # (B, Ms+n_new, kvh*hd) the sink candidates'
    span: Span,
    kvh: int,
) -> torch.Tensor:
    """softmax over [sinks; window] of the scores plus the masks, times the values ->
    (B, T, H*hd). The two parts' queries differ (their rotations), and two layouts serve:
    a chunk (T > 1) scores both parts in one product (`_joined`); one query per stream (a
    decode step) scores them apart, reading the cached keys and values where they lie
    (`_apart`), since joining them would copy the whole window every step."""
    B, T, D = q.shape
    hd = window[0].shape[-1] // kvh
    Ks = sinks[0].shape[1] if q_sink is not None else 0
    qg = _grouped(q, kvh, hd)  # (B, kvh, g*T, hd)
    if Ks and q_sink is not None:
        qs, sk = _grouped(q_sink, kvh, hd), (_heads(sinks[0], kvh), _heads(sinks[1], kvh))
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
        return a @ b
    return torch.stack([torch.bmm(a[:, h], b[:, h]) for h in range(H)], 1)


def _apart(
    qg: torch.Tensor, qs: torch.Tensor | None, win: Pair, sk: Pair | None, masks: Masks, T: int
) -> torch.Tensor:
    """Each part scored by its own product, one softmax over both -> (B, kvh, g*T, hd)."""
    scores = _masked(_in_place(qg, win[0].transpose(-1, -2)), masks[1], T)  # (B, kvh, g*T, Kw)
    Ks = 0
    if qs is not None and sk is not None:
        Ks = sk[0].shape[2]
        scores = torch.cat([_masked(qs @ sk[0].transpose(-1, -2), masks[0], T), scores], -1)
    p = scores.float().softmax(-1).to(win[1].dtype)
    out = _in_place(p[..., Ks:], win[1])
    if sk is not None and Ks:
        B, kvh, gT, hd = out.shape
        out = torch.baddbmm(
            out.view(B * kvh, gT, hd), p[..., :Ks].reshape(B * kvh, gT, Ks), sk[1].reshape(B * kvh, Ks, hd)
        )
    return out.view(p.shape[0], p.shape[1], -1, win[1].shape[-1])


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
    p = scores.float().softmax(-1).to(win[1].dtype)
    return p @ torch.cat([sk[1], win[1]], 2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # nn.Linear, or its int8 form (`Llama.quantize`)
        self.qkv: nn.Module = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False
        )
        self.proj: nn.Module = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d), already normalised
        span: Span,
        kv: KV,
        sinks: Pair,  # this layer's stored sinks (B, Ms, kvh*hd)
    ) -> tuple[torch.Tensor, Pair]:
        """The attention's output (B, T, d), and the chunk's first `span.n_new` keys and
        values (the rows that may become sinks)."""
        H, kvh, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([H * hd, kvh * hd, kvh * hd], -1)
        q = q * hd**-0.5
        k = apply_rope(k, span.cs, kvh)  # at absolute positions, as the cache keeps them
        fresh = (k[:, : span.n_new], v[:, : span.n_new])
        q_sink = None
        if span.cs_sink is not None:
            q_sink = apply_rope(q, span.cs_sink, H)
            sinks = (torch.cat([sinks[0], fresh[0]], 1), torch.cat([sinks[1], fresh[1]], 1))
        out = attend(apply_rope(q, span.cs, H), q_sink, kv(k, v), sinks, span, kvh)
        return self.proj(out), fresh


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x), gate and up as one matrix."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up: nn.Module = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down: nn.Module = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, span: Span, kv: KV, sinks: Pair) -> tuple[torch.Tensor, Pair]:
        a, fresh = self.attn(rms_norm(x, self.norm1), span, kv, sinks)
        x = x + a
        return x + self.mlp(rms_norm(x, self.norm2)), fresh


# -- the model ----------------------------------------------------------------------------
class Llama(LanguageModel):
    family = "llama"
    config_class = LlamaConfig
    persistent = ("k", "v", "sink_k", "sink_v", "last_hidden", "n_tokens")  # all of it
    serving_options = ("sinks", "window", "tgt_len")

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        cfg = config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head: nn.Module = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_weights)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight

    def blocks(self) -> list[Block]:
        return list(self.layers)  # type: ignore[arg-type]

    @property
    def context_window(self) -> int:
        return self.config.sinks + self.config.window + 1

    def quantize(self) -> None:
        """Every linear layer (q, k, v; the attention's output; the MLP; the head) in int8,
        `model/int8.py`; the embedding stays a float table (a lookup reads one row)."""
        if self.device.type != "cpu":
            raise ValueError("int8 weights are a CPU path: serve on CUDA in bf16 or fp32")
        for blk in self.blocks():
            blk.attn.qkv, blk.attn.proj = int8_linear(blk.attn.qkv), int8_linear(blk.attn.proj)
            blk.mlp.gate_up, blk.mlp.down = int8_linear(blk.mlp.gate_up), int8_linear(blk.mlp.down)
        self.head = int8_linear(self.head)
        self.precision = "int8"

    # -- state ------------------------------------------------------------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        cfg = self.config
        width = cfg.n_kv_head * cfg.head_dim
        window = TimeAxis(cfg.n_layer, width, cfg.window)
        sinks = TimeAxis(cfg.n_layer, width, cfg.sinks, fills=True)
        return {"k": window, "v": window, "sink_k": sinks, "sink_v": sinks}

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"last_hidden": (self.config.d_model,)}

    def batch_layouts(self) -> dict[str, bool]:
        return {"k": False, "v": False}  # `advance` grows the window in place; the sinks fill apart

    def check_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().check_state_tensors(tensors)
        for k, v in (("k", "v"), ("sink_k", "sink_v")):
            if tensors[k].shape != tensors[v].shape:
                raise StateError(f"state {k} and {v} differ in shape")

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        return self._state(dict(tensors))  # every tensor is persistent: nothing to recompute

    # -- forward ----------------------------------------------------------------------------
    def span(self, n: torch.Tensor, T: int, M: int, Ms: int) -> Span:
        """The rotations and masks of a chunk of T tokens after `n` (B,) consumed, over M
        window rows and Ms stored sinks (left-padded rows included)."""
        cfg = self.config
        S, W, dev = cfg.sinks, cfg.window, n.device
        # one host read (eager only): how many chunk rows may be sinks, and which masks can
        # be left out; a graph being compiled reads nothing from the host and masks always
        n_min = 0 if torch.compiler.is_compiling() else int(n.min())
        n_new = min(T, max(0, S - n_min))
        pos = n[:, None] + torch.arange(T, device=dev)  # (B, T) absolute positions
        dtype = self.tok_emb.weight.dtype
        cs = rope_angles(pos, cfg.head_dim, cfg.rope_base, dtype)
        window = None
        if T > 1 or n_min < S + M:  # else every row's window keys are all in reach, no sink among them
            kpos = n[:, None] - M + torch.arange(M + T, device=dev)  # (B, M+T); padding: < 0
            dist = pos[:, :, None] - kpos[:, None]  # (B, T, M+T)
            window = _bias((kpos[:, None] >= S) & (dist >= 0) & (dist <= W))
        if S == 0 or Ms + n_new == 0:
            return Span(cs, None, window, None, 0)
        cs_sink = rope_angles(pos.clamp(max=S + W), cfg.head_dim, cfg.rope_base, dtype)
        sink = None
        if n_new or n_min < Ms:
            spos = sink_positions(n, Ms, pos, n_new, S)[:, None]  # (B, 1, Ms+n_new)
            sink = _bias((spos >= 0) & (spos < S) & (spos <= pos[:, :, None]))
        return Span(cs, cs_sink, window, sink, n_new)

    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        n = state.n_tokens
        M, Ms = state["k"].shape[2], state["sink_k"].shape[2]
        span = self.span(n, T, M, Ms)
        grown = {name: state.window(name).grow(T, how.in_place) for name in ("k", "v")}
        fresh: list[Pair] = []
        with self.autocast():
            x = self.tok_emb(tokens)  # (B, T, d)
            for i, blk in enumerate(self.blocks()):
                kv = kv_appender(grown["k"], grown["v"], i)
                x, new = blk(x, span, kv, (state["sink_k"][:, i], state["sink_v"][:, i]))
                fresh.append(new)
            logits = self.head(rms_norm(x, self.norm_out))  # (B, T, V)
        dtype = state["k"].dtype
        tensors, arenas = unzip({name: g.result(min(cfg.window, M + T)) for name, g in grown.items()})
        tensors["sink_k"], tensors["sink_v"] = self._sinks(state, fresh, T)
        tensors["last_hidden"] = x[:, -1].to(dtype)
        tensors["n_tokens"] = n + T
        logits = logits.float()
        tensors["next_logits"] = logits[:, -1].clone() if T > 1 else logits[:, 0]
        return logits, self._state(tensors, arenas)

    def _sinks(self, state: State, fresh: list[Pair], T: int) -> Pair:
        """The sinks after a chunk of T tokens: each row's first min(n_b + T, S) positions,
        left-padded (with zeros) to the longest, from its stored sinks and the chunk's
        first rows (`fresh`, per layer)."""
        old_k, old_v = state["sink_k"], state["sink_v"]
        n_new = fresh[0][0].shape[1] if fresh else 0
        if n_new == 0:  # every row holds its S sinks already
            return old_k, old_v
        S, n = self.config.sinks, state.n_tokens
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
        for old, part in ((old_k, 0), (old_v, 1)):
            cand = torch.cat(
                [old, torch.stack([f[part] for f in fresh], 1).to(old.dtype)], 2
            )  # (B, L, Ms+n_new, D)
            out.append(torch.where(real, cand.gather(2, idx), torch.zeros((), dtype=old.dtype)))
        return out[0], out[1]

    def next_logits(self, state: State) -> torch.Tensor:
        cached = state.tensors.get("next_logits")
        if cached is not None:
            return cached
        with self.autocast():
            return self.head(rms_norm(state["last_hidden"], self.norm_out)).float()
