"""The Recurrent Looped Transformer, RLT-1 (Zhang, Feng and Qin, 2026), and its RLT-0 variant.

Read top to bottom: config, masks, attention, blocks, the model (RoPE and RMSNorm are the
layers room's: `model/rotary.py`, `model/norms.py`).

Notation follows the report:
  e_t               causal encoder output at position t (L_E pre-norm blocks, RoPE on q, k)
  k_t^g, v_t^g      global KV memory, G groups; decoder layer l reads group l mod G,
                    and position t reads only entries j <= t (prefix-restricted)
  r  = RMSNorm(s_{t-1})
  g  = sigmoid(W_g [e_t; r] + b_g)                 gated merge
  u_t = e_t + alpha * g (.) (W_s r)                 decoder input (RLT-0: u_t = e_t)
  s_t = output of the last of L_D decoder blocks     s_0 = s* (learned)
        each block: sliding-window self-attention (window W, current token included),
        cross-attention to the memory prefix, FFN; pre-norm with residuals
  logits_t = W_o RMSNorm(s_t)                        predicts token t+1

Execution. A chunk of T tokens runs the encoder as one causal batch (attending to its
cached keys and values) and projects the chunk's memory entries at once; the decoder
recurrence then runs token by token, since u_t needs s_{t-1}. That time loop is inherent;
batch and heads are vectorised. RLT-0 has no recurrence through s, so its decoder runs over
the whole chunk at once.

State (batch-first; all persistent, nothing derived):
  s       [B, d]             s_t (s* for a fresh stream)
  enc_k/v [B, L_E, M, d]     per-encoder-layer keys/values, at most C-1 past positions
  mem_k/v [B, G, M, d]       memory entries, at most C-1 past positions
  swa_k/v [B, L_D, S, d]     per-decoder-layer window cache, at most W-1 past positions
  n_tokens [B]               absolute position of the next token (RoPE uses it)
Keys are stored already rotated at their absolute position. At a state precision below
float32 (`set_state_dtype`) every cache row is rounded as it is appended and every query,
its own chunk's included, reads the rounded rows (`model.state.precision`); s stays
float32. Time axes are left-padded when streams of different lengths are batched; masks
ignore the padding. Nothing in the state
is detached: training back-propagates through s_t, the window caches and the encoder and
memory entries into earlier segments until `recur train` truncates (`--bptt-segments`).

Deviations from the report, both made for serving:
  * Bounded context, `max_context` = C. The report keeps the whole prefix in the encoder
    caches and the memory, so a never-ending session grows without bound. Here every
    position t attends to exactly the positions (t - C, t] in encoder self-attention and in
    memory cross-attention (a sliding window), and the state keeps at most C-1 past entries
    per encoder layer and memory group. Because the window is applied per position, not per
    chunk, results never depend on where chunk or request boundaries fell, even for a chunk
    longer than C. Within the first C tokens of a stream the bound changes nothing.
  * RoPE in the memory is applied after the projection, per head, to both the memory keys
    and the cross-attention queries (the usual placement), so memory scores depend on the
    distance t - j only; read literally, the notation W_K^g RoPE(.) would make them depend
    on absolute position, which drifts out of the trained range in long sessions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .family import Execution, LanguageModel, TimeAxis, init_weights
from .norms import RMSNorm, rms_norm
from .rotary import Rope, apply_rope, rope_angles
from .state import Growth, State, StateError, kv_appender, unzip
from .state.precision import PRECISIONS, snap

# appends a layer's new keys and values to its cache, returns all of them (B, S+T, d)
Pair = tuple[torch.Tensor, torch.Tensor]  # a key and a value
KV = Callable[[torch.Tensor, torch.Tensor], Pair]


@dataclass
class RLTConfig:
    vocab_size: int = 258
    n_encoder_layers: int = 2  # L_E
    n_decoder_layers: int = 2  # L_D
    d_model: int = 128
    n_head: int = 4
    d_ff: int = 512
    window: int = 16  # W: decoder self-attention span, current token included
    memory_groups: int = 1  # G
    max_context: int = 512  # C: encoder and memory span, current token included
    alpha: float = 0.1
    feedback: bool = True  # False: RLT-0, the decoder input is e_t
    tie_encoder_decoder: bool = False  # decoder block l shares self-attn + FFN of encoder block l mod L_E
    tie_weights: bool = True  # W_o is the token embedding
    tgt_len: int = 64  # training chunk; also the serving chunk size (results do not depend on it)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1:
            raise ValueError("n_encoder_layers and n_decoder_layers must be >= 1")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError("d_model must split into n_head heads of even size (RoPE rotates pairs)")
        if self.window < 1 or self.max_context < 1 or self.tgt_len < 1:
            raise ValueError("window, max_context and tgt_len must be >= 1")
        if not 1 <= self.memory_groups <= self.n_decoder_layers:
            raise ValueError("memory_groups must be between 1 and n_decoder_layers")


# -- positions and masks ------------------------------------------------------------------
def window_mask(
    q0: int, T: int, k0: int, K: int, span: int, first_valid: torch.Tensor, padded: bool
) -> torch.Tensor | None:
    """(B, 1, T, K) True where query may attend: 0 <= q - k < span and k is not left padding;
    None where every query may attend every key (one query whose keys all lie in its span,
    and no padding: the attention then needs no mask).

    Queries are the positions q0 .. q0+T-1 and keys k0 .. k0+K-1 in one key array [cache;
    chunk]; first_valid [B] is where each row's real entries start (everything before is
    padding from batching); `padded`: whether any row has padding.
    """
    if q0 >= k0 + K - 1 and q0 + T - 1 - k0 < span and not padded:
        return None
    dev = first_valid.device
    k_idx = torch.arange(k0, k0 + K, device=dev)
    dist = torch.arange(q0, q0 + T, device=dev)[:, None] - k_idx  # (T, K)
    ok = (dist >= 0) & (dist < span)
    real = k_idx >= first_valid[:, None]  # (B, K)
    return (ok[None] & real[:, None])[:, None]


def real_keys(first_valid: torch.Tensor, K: int, padded: bool) -> torch.Tensor | None:
    """(B, 1, 1, K) True where key k is not left padding (k >= first_valid [B]), or None where
    no row is `padded`. A query's slice of it is its mask when its keys are sliced to its span."""
    if not padded:
        return None
    return (torch.arange(K, device=first_valid.device) >= first_valid[:, None])[:, None, None]


def _in_reach(start: int, T: int, width: int, first: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Which of the `width` slots each of T tokens reaches hold a real row (B, T, 1, 1, width):
    token t's slots are rows start + t - (width - 1) .. start + t; a row is real from `first`."""
    row = start + torch.arange(T, device=dev)[:, None] - (width - 1) + torch.arange(width, device=dev)
    return (row >= first[:, None, None])[:, :, None, None]


def _memory_rows(k: torch.Tensor, v: torch.Tensor, rows: int, at: int, n_head: int) -> Pair:
    """A memory group's entries k, v (B, Mm+T, d) at row `at` of zeroed buffers `rows` long,
    heads split: every token's slice of them then has the same strides."""
    B, n, d = k.shape
    kb, vb = k.new_zeros(B, rows, d), v.new_zeros(B, rows, d)
    kb[:, at : at + n], vb[:, at : at + n] = k, v
    return split_heads(kb, n_head), split_heads(vb, n_head)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x in the row-major layout of its shape, strides of size-1 dimensions included (a
    compiled graph guards on every stride)."""
    return x.clone(memory_format=torch.contiguous_format)


def _last_padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last n rows of x (B, K, d), zero rows before them where K < n."""
    K = x.shape[1]
    return x[:, K - n :] if K >= n else torch.cat([x.new_zeros(x.shape[0], n - K, x.shape[2]), x], 1)


def _shifting(window: Pair, shifted: list[Pair], new: list[Pair], precision: str) -> KV:
    """For a decoder layer stepping one token (`RLT.decode_token`): attend over the window's
    keys and values then the new ones (rounded to the state's precision, as the window cache
    will keep them), and record the window the next token sees (the new ones last, the oldest
    dropped) and the new ones."""

    def kv(k_new: torch.Tensor, v_new: torch.Tensor) -> Pair:
        k_new, v_new = snap(k_new, precision), snap(v_new, precision)
        k, v = torch.cat([window[0], k_new], 1), torch.cat([window[1], v_new], 1)
        shifted.append((_dense(k[:, 1:]), _dense(v[:, 1:])))  # one layout every token
        new.append((k_new, v_new))
        return k, v

    return kv


def window_appender(k: Growth, v: Growth, i: int, span: int) -> KV:
    """For decoder layer i stepping one token: append its key and value to the window cache,
    get back the last `span` of them."""
    return lambda k_new, v_new: (k.append(i, k_new)[:, -span:], v.append(i, v_new)[:, -span:])


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, K, D) -> a view (B, nh, K, hd)."""
    B, K, D = x.shape
    return x.view(B, K, n_head, D // n_head).transpose(1, 2)


def attend(
    q: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    allowed: torch.Tensor | None,
    n_head: int,
    fixed: bool = False,  # the keys are as many in every call (`RLT.decode_token`)
) -> torch.Tensor:
    """q (B, T, D), kh, vh (B, nh, K, hd), allowed (B, 1, T, K) or None (all) -> (B, T, D)."""
    B, T, D = q.shape
    hd = D // n_head
    if fixed and torch.compiler.is_compiling():
        # one query over a fixed number of keys, compiled: written out, the compiler fuses
        # scores, softmax and sum into loops of known length, at a few hundred keys faster
        # than a call to the attention kernel (over a length that varies, slower)
        scores = (q.view(B, n_head, 1, hd) @ kh.transpose(-1, -2)) * hd**-0.5
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ vh).view(B, 1, D)
    if T == 1:  # one query: splitting its heads is a view, and so is joining them
        out = F.scaled_dot_product_attention(q.view(B, n_head, 1, hd), kh, vh, attn_mask=allowed)
        return out.view(B, 1, D)
    qh = q.view(B, T, n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed)  # (B, nh, T, hd)
    return out.transpose(1, 2).reshape(B, T, D)


# -- modules ------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Causal self-attention with RoPE on q, k over [cached keys; new keys]."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d), already normalised
        cs: Rope,
        kv: KV,  # cached rotated keys and values of earlier positions (B, S, d)
        allowed: torch.Tensor | None,  # (B, 1, T, S+T), or None: every key
        fixed: bool = False,  # as many keys in every call (`attend`)
    ) -> torch.Tensor:
        d = x.shape[-1]
        qkv = F.linear(x, self.qkv.weight)  # (B, T, 3d)
        q, k = apply_rope(qkv[..., : 2 * d], cs, 2 * self.n_head).chunk(2, -1)  # q's and k's heads at once
        k, v = kv(k, qkv[..., 2 * d :])  # (B, S+T, d)
        kh, vh = split_heads(k, self.n_head), split_heads(v, self.n_head)
        return F.linear(attend(q, kh, vh, allowed, self.n_head, fixed), self.proj.weight)


class CrossAttention(nn.Module):
    """Decoder queries (rotated at their position) against a memory group's entries."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cs: Rope,
        kh: torch.Tensor,  # (B, nh, K, hd) the memory entries in reach, split into heads
        vh: torch.Tensor,
        allowed: torch.Tensor | None,
        fixed: bool = False,  # as many keys in every call (`attend`)
    ) -> torch.Tensor:
        q = apply_rope(F.linear(x, self.q.weight), cs, self.n_head)
        return F.linear(attend(q, kh, vh, allowed, self.n_head, fixed), self.proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.fc.weight)), self.proj.weight)


class EncoderBlock(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cs: Rope, kv: KV, allowed: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.norm1), cs, kv, allowed)
        return x + self.mlp(rms_norm(x, self.norm2))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SelfAttention(cfg)  # sliding window W
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.cross = CrossAttention(cfg)
        self.norm3 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d)
        cs: Rope,
        kv: KV,  # the window cache (B, S, d)
        self_allowed: torch.Tensor | None,  # (B, 1, T, S+T), or None: every key
        mem_k: torch.Tensor,  # (B, nh, K, hd) this layer's memory group, the entries in reach
        mem_v: torch.Tensor,
        mem_allowed: torch.Tensor | None,  # (B, 1, T, K), or None: every entry
        fixed: bool = False,  # as many keys in every call (`attend`)
    ) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.norm1), cs, kv, self_allowed, fixed)
        x = x + self.cross(rms_norm(x, self.norm2), cs, mem_k, mem_v, mem_allowed, fixed)
        return x + self.mlp(rms_norm(x, self.norm3))


class Memory(nn.Module):
    """k_t^g = RoPE(W_K^g RMSNorm(e_t), t), v_t^g = W_V^g RMSNorm(e_t), for all G groups."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.G, self.n_head = cfg.memory_groups, cfg.n_head
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.k = nn.Linear(cfg.d_model, self.G * cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, self.G * cfg.d_model, bias=False)

    def forward(self, e: torch.Tensor, cs: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = e.shape
        h = rms_norm(e, self.norm)
        k = apply_rope(F.linear(h, self.k.weight), cs, self.G * self.n_head)  # (B, T, G*d)
        v = F.linear(h, self.v.weight)
        return k.view(B, T, self.G, d).transpose(1, 2), v.view(B, T, self.G, d).transpose(
            1, 2
        )  # (B, G, T, d)


class Merge(nn.Module):
    """u_t = e_t + alpha * sigmoid(W_g [e_t; r] + b_g) (.) (W_s r), r = RMSNorm(s_{t-1})."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.alpha = cfg.alpha
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(2 * cfg.d_model, cfg.d_model)  # W_g, b_g
        self.W_s = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def prepare(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a chunk's steps share: the gate's e_t part W_g[:, :d] e_t + b_g for every
        position (B, T, d), and one weight [W_g[:, d:]; W_s] (2d, d) mapping r to both the
        gate's r part and W_s r, so that a step multiplies r once."""
        d = e.shape[-1]
        w = self.gate.weight
        return F.linear(e, w[:, :d], self.gate.bias), torch.cat([w[:, d:], self.W_s.weight])

    def forward(
        self, e: torch.Tensor, ge: torch.Tensor, s_prev: torch.Tensor, w_r: torch.Tensor
    ) -> torch.Tensor:
        """u_t (B, 1, d) from e_t, its gate part ge_t (`prepare`) and s_{t-1}, each (B, 1, d)."""
        g_r, w_s_r = F.linear(rms_norm(s_prev, self.norm), w_r).chunk(2, -1)
        return torch.addcmul(e, torch.sigmoid(ge + g_r), w_s_r, value=self.alpha)


# -- the model ----------------------------------------------------------------------------
Memories = tuple[list[torch.Tensor], list[torch.Tensor]]  # per memory group: k, v (B, Mm+T, d)


class Reach(NamedTuple):
    """What the decoder reads over one chunk of T tokens, besides its inputs (`RLT._reach`)."""

    cs: Rope  # the chunk's positions' angles
    sk: Growth  # the window caches' keys and values (B, L_D, S, d), growing by T
    sv: Growth
    mem: Memories  # the memory's entries, the chunk's among them
    S: int  # window cache rows before the chunk
    Mm: int  # memory entries before the chunk
    swa_first: torch.Tensor  # (B,) each row's first real window cache row
    mem_first: torch.Tensor  # (B,) and first real memory entry
    padded: tuple[bool, bool]  # whether the window caches, the memory hold left padding


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 logits (CUDA autocast) come back as fp32; fp64 (gradient checks) stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RLT(LanguageModel):
    family = "rlt"
    config_class = RLTConfig
    persistent = ("s", "enc_k", "enc_v", "mem_k", "mem_v", "swa_k", "swa_v", "n_tokens")  # all of it
    # every cache rounded as appended (`model.state.precision`); s stays float32
    cache_precisions = PRECISIONS

    def __init__(self, config: RLTConfig):
        super().__init__(config)
        cfg = config
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_encoder_layers))
        self.memory = Memory(cfg)
        self.merge = Merge(cfg) if cfg.feedback else None
        self.s_star = nn.Parameter(torch.zeros(d))  # s_0
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm_out = RMSNorm(d, cfg.norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)  # W_o
        self.apply(init_weights)
        nn.init.normal_(self.s_star, 0.0, 0.02)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        if cfg.tie_encoder_decoder:
            for i, blk in enumerate(self.decoder):
                src = self.encoder[i % cfg.n_encoder_layers]
                blk.norm1, blk.attn, blk.norm3, blk.mlp = src.norm1, src.attn, src.norm2, src.mlp

    # -- state: s_t and the encoder, memory and window caches ----------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        cfg = self.config
        enc = TimeAxis(cfg.n_encoder_layers, cfg.d_model, cfg.max_context - 1)
        mem = TimeAxis(cfg.memory_groups, cfg.d_model, cfg.max_context - 1)
        swa = TimeAxis(cfg.n_decoder_layers, cfg.d_model, cfg.window - 1)
        return {"enc_k": enc, "enc_v": enc, "mem_k": mem, "mem_v": mem, "swa_k": swa, "swa_v": swa}

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"s": (self.config.d_model,)}

    def batch_layouts(self) -> dict[str, bool]:
        return dict.fromkeys(self.time_axes(), False)  # `advance` grows every axis, row-major

    def new_state(self, batch_size: int = 1) -> State:
        s0 = self.s_star.expand(batch_size, self.config.d_model)  # training: gradients reach s*
        if not (self.training and torch.is_grad_enabled()):
            s0 = s0.detach().clone()
        return super().new_state(batch_size).replace(s=s0)

    def check_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().check_state_tensors(tensors)
        for prefix in ("enc", "mem", "swa"):
            if tensors[prefix + "_k"].shape != tensors[prefix + "_v"].shape:
                raise StateError(f"state {prefix}_k and {prefix}_v differ in shape")

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        return self._state(dict(tensors))  # every tensor is persistent: nothing to recompute

    # -- forward --------------------------------------------------------------------------
    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        n = state.n_tokens
        pos = n[:, None] + torch.arange(T, device=tokens.device)  # (B, T) absolute positions
        cs = rope_angles(pos, cfg.d_model // cfg.n_head, cfg.rope_base, self.tok_emb.weight.dtype)
        ctx_valid = n.clamp(max=cfg.max_context - 1)  # (B,) real cached encoder / memory entries per row
        # one host read: which time axes hold left padding (`_padded`); a graph being compiled
        # reads nothing from the host (it would break in two) and masks as if every axis might
        n_min = 0 if torch.compiler.is_compiling() else int(n.min())
        in_place = how.in_place
        axes = self.time_axes()
        grown = {name: state.window(name).grow(T, in_place) for name in axes}
        with self.autocast():
            e = self._encode(tokens, cs, grown["enc_k"], grown["enc_v"], ctx_valid, n_min)  # (B, T, d)
            mem = self._remember(e, cs, grown["mem_k"], grown["mem_v"])
            reach = self._reach(cs, grown["swa_k"], grown["swa_v"], mem, n, ctx_valid, n_min)
            s_all = self._recur(e, state["s"], reach, how.parts.get("decode_token"))  # (B, T, d)
            logits = F.linear(rms_norm(how.logit_rows(s_all), self.norm_out), self.head.weight)  # (B, T or 1, V)
        tensors, arenas = unzip({name: g.result(min(axes[name].bound, g.M + T)) for name, g in grown.items()})
        tensors["s"] = s_all[:, -1].to(state["s"].dtype)
        tensors["n_tokens"] = n + T
        return _at_least_fp32(logits), self._state(tensors, arenas)

    def _padded(self, n_min: int, axis: str, rows: int) -> bool:
        """Whether a time axis holding `rows` rows is left-padded in some stream: one that has
        consumed n_min tokens holds min(n_min, bound) real rows."""
        return min(n_min, self.time_axes()[axis].bound) < rows

    def _encode(
        self, tokens: torch.Tensor, cs: Rope, ek: Growth, ev: Growth, ctx_valid: torch.Tensor, n_min: int
    ) -> torch.Tensor:
        """The causal encoder, one batch over the chunk: tokens (B, T) -> e (B, T, d)."""
        T, M, C = tokens.shape[1], ek.M, self.config.max_context
        # keys [cache (M); chunk (T)]; row b's real cached entries are its last ctx_valid[b]
        allowed = window_mask(M, T, 0, M + T, C, M - ctx_valid, self._padded(n_min, "enc_k", M))
        x = self.tok_emb(tokens)  # (B, T, d)
        for i, blk in enumerate(self.encoder):
            x = blk(x, cs, kv_appender(ek, ev, i), allowed)
        return x

    def _remember(self, e: torch.Tensor, cs: Rope, gk: Growth, gv: Growth) -> Memories:
        """Append the chunk's global memory entries: per group, its cached entries then the
        chunk's, k and v (B, Mm+T, d)."""
        mk, mv = self.memory(e, cs)  # (B, G, T, d)
        groups = range(self.config.memory_groups)
        # one tensor per group: a decoder step's gradient then touches one group only
        return [gk.append(g, mk[:, g]) for g in groups], [gv.append(g, mv[:, g]) for g in groups]

    def _reach(
        self,
        cs: Rope,
        sk: Growth,
        sv: Growth,
        mem: Memories,
        n: torch.Tensor,
        ctx_valid: torch.Tensor,
        n_min: int,
    ) -> Reach:
        """What the decoder reads over the chunk (`Reach`) for streams that have consumed n."""
        S, Mm = sk.M, mem[0][0].shape[1] - cs[0].shape[1]
        swa_first = S - n.clamp(max=self.config.window - 1)
        padded = (self._padded(n_min, "swa_k", S), self._padded(n_min, "mem_k", Mm))
        return Reach(cs, sk, sv, mem, S, Mm, swa_first, Mm - ctx_valid, padded)

    def _recur(self, e: torch.Tensor, s0: torch.Tensor, reach: Reach, token: Callable | None) -> torch.Tensor:
        """The decoder over the chunk, from its encoder outputs e (B, T, d) and s before it
        (B, d), with a compiled `decode_token` to step with where `token` is one (`parts`): s_t
        for every position (B, T, d)."""
        if self.merge is None:  # RLT-0: u_t = e_t, the whole chunk at once
            return self._decode_chunk(e, reach)
        if token is not None:  # a compiled step of one shape
            return self._decode_fixed(token, e, s0, reach)
        return self._decode_steps(e, s0, reach)

    def _decode_chunk(self, x: torch.Tensor, r: Reach) -> torch.Tensor:
        """The decoder blocks over a whole chunk of inputs u (B, T, d) (RLT-0, where u does
        not depend on s)."""
        cfg, T = self.config, x.shape[1]
        cs, sk, sv, mem, S, Mm, swa_first, mem_first, padded = r
        # window keys [cache (S); chunk (T)]; memory entries in reach of the chunk [lo, Mm + T)
        self_allowed = window_mask(S, T, 0, S + T, cfg.window, swa_first, padded[0])
        lo = max(0, Mm + 1 - cfg.max_context)
        mem_allowed = window_mask(Mm, T, lo, Mm + T - lo, cfg.max_context, mem_first, padded[1])
        H = cfg.n_head
        for i, blk in enumerate(self.decoder):
            g = i % cfg.memory_groups
            mk, mv = split_heads(mem[0][g][:, lo:], H), split_heads(mem[1][g][:, lo:], H)
            x = blk(x, cs, kv_appender(sk, sv, i), self_allowed, mk, mv, mem_allowed)
        return x

    def _decode_steps(self, e: torch.Tensor, s0: torch.Tensor, r: Reach) -> torch.Tensor:
        """RLT-1: the recurrence, one token at a time (u_t needs s_{t-1}). Everything that does
        not need s was done for the whole chunk; a step slices its keys to its span, so only
        left padding (rare: batched streams of different lengths) needs a mask."""
        cfg = self.config
        T, W, C = e.shape[1], cfg.window, cfg.max_context
        cs, sk, sv, mem, S, Mm, swa_first, mem_first, padded = r
        swa_real, mem_real = real_keys(swa_first, S + T, padded[0]), real_keys(mem_first, Mm + T, padded[1])
        assert self.merge is not None
        ge, w_r = self.merge.prepare(e)
        mem_h = [(split_heads(k, cfg.n_head), split_heads(v, cfg.n_head)) for k, v in zip(*mem, strict=True)]
        s = s0[:, None]  # (B, 1, d) s_{t-1}
        outs = []
        for t in range(T):
            x = self.merge(e[:, t : t + 1], ge[:, t : t + 1], s, w_r)  # u_t (B, 1, d)
            cs_t = (cs[0][:, t : t + 1], cs[1][:, t : t + 1])
            w0, m0 = max(0, S + t + 1 - W), max(0, Mm + t + 1 - C)  # first key in reach
            self_allowed = None if swa_real is None else swa_real[..., w0 : S + t + 1]
            mem_allowed = None if mem_real is None else mem_real[..., m0 : Mm + t + 1]
            for i, blk in enumerate(self.decoder):
                mk, mv = mem_h[i % cfg.memory_groups]
                mk, mv = mk[:, :, m0 : Mm + t + 1], mv[:, :, m0 : Mm + t + 1]
                x = blk(x, cs_t, window_appender(sk, sv, i, W), self_allowed, mk, mv, mem_allowed)
            s = x
            outs.append(s)
        return torch.cat(outs, 1)  # (B, T, d)

    def parts(self) -> dict[str, Callable]:
        return {"decode_token": self.decode_token} if self.merge is not None else {}

    def _decode_fixed(self, token: Callable, e: torch.Tensor, s0: torch.Tensor, r: Reach) -> torch.Tensor:
        """`_decode_steps` with every step's inputs of one shape and one layout, whatever
        the chunk, so that one compiled graph serves every token: the window's last W-1 keys
        and values and the memory's C entries in reach, left-padded with zeros where there
        are fewer and masked, in place of slices that grow token by token; per-token inputs
        time-major, so a token's slice does not depend on the chunk's length. The same keys
        are attended; the padding is masked out. `token`: `decode_token`, or a compiled one."""
        cfg = self.config
        T, W, C = e.shape[1], cfg.window, cfg.max_context
        cs, sk, sv, mem, S, Mm, swa_first, mem_first, _ = r  # (it masks, padding or not)
        dev = e.device
        assert self.merge is not None
        ge, w_r = self.merge.prepare(e)
        # memory rows at C-1 .. in a buffer as long as any chunk needs: token t's entries in
        # reach are rows [Mm+t, Mm+t+C), and every slice has the same strides
        rows = 2 * (C - 1) + max(T, self.segment_len)
        mem_h = [_memory_rows(k, v, rows, C - 1, cfg.n_head) for k, v in zip(*mem, strict=True)]
        mem_ok = _in_reach(Mm, T, C, mem_first, dev)  # (B, T, 1, 1, C) the entry in each slot
        win_ok = _in_reach(S, T, W, swa_first, dev)  # (B, T, 1, 1, W): the last, the new row
        # time-major (T, B, ...), dense: token t's slice has the same strides in every chunk,
        # and is one index away from what the step takes (B, 1, ...)
        e_t, ge_t, cos, sin = (_dense(x.transpose(0, 1)[:, :, None]) for x in (e, ge, cs[0], cs[1]))
        win_ok, mem_ok = _dense(win_ok.transpose(0, 1)), _dense(mem_ok.transpose(0, 1))
        window = [
            (_dense(_last_padded(sk.old[:, i], W - 1)), _dense(_last_padded(sv.old[:, i], W - 1)))
            for i in range(len(self.decoder))
        ]
        s = _dense(s0[:, None])
        outs = []
        fresh: list[list[Pair]] = [[] for _ in self.decoder]
        for t in range(T):
            mems = [(k[:, :, Mm + t : Mm + t + C], v[:, :, Mm + t : Mm + t + C]) for k, v in mem_h]
            args = (e_t[t], ge_t[t], s, w_r, (cos[t], sin[t]), window, mems)
            s, window, new = token(*args, win_ok[t], mem_ok[t])
            for i, kv in enumerate(new):
                fresh[i].append(kv)
            outs.append(s)
        for i, rows in enumerate(fresh):  # the chunk's keys and values join the window cache at once
            sk.append(i, torch.cat([k for k, _ in rows], 1))
            sv.append(i, torch.cat([v for _, v in rows], 1))
        return torch.cat(outs, 1)

    def decode_token(
        self,
        e: torch.Tensor,  # (B, 1, d) e_t
        ge: torch.Tensor,  # (B, 1, d) its gate part (`Merge.prepare`)
        s: torch.Tensor,  # (B, 1, d) s_{t-1}
        w_r: torch.Tensor,
        cs: Rope,
        window: list[Pair],  # per decoder layer: the last W-1 keys, values
        mems: list[Pair],  # per memory group: the C entries in reach, heads split
        win_ok: torch.Tensor,  # (B, 1, 1, W) which window keys (the new one last) are real
        mem_ok: torch.Tensor,  # (B, 1, 1, C) which memory entries are real
    ) -> tuple[torch.Tensor, list[Pair], list[Pair]]:
        """One step of the recurrence (`_decode_fixed`), a pure function of tensors of fixed
        shapes: s_t (B, 1, d); each decoder layer's window with the new key and value last
        (B, W-1, d), its oldest row dropped; and each layer's new key and value (B, 1, d)."""
        assert self.merge is not None
        x = self.merge(e, ge, s, w_r)  # u_t
        shifted: list[Pair] = []
        new: list[Pair] = []
        for i, blk in enumerate(self.decoder):
            mk, mv = mems[i % self.config.memory_groups]
            kv = _shifting(window[i], shifted, new, self.state_precision)
            x = blk(x, cs, kv, win_ok, mk, mv, mem_ok, fixed=True)
        return x, shifted, new

    def next_logits(self, state: State) -> torch.Tensor:
        with self.autocast():
            return _at_least_fp32(F.linear(rms_norm(state["s"], self.norm_out), self.head.weight))
