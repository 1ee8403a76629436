"""The Recurrent Looped Transformer, RLT-1 (Zhang, Feng and Qin, 2026), and its RLT-0 variant.

Read top to bottom: config, RoPE and masks, attention, blocks, the model.

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
Keys are stored already rotated at their absolute position. Time axes are left-padded when
streams of different lengths are batched; masks ignore the padding. Nothing in the state
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

import torch
import torch.nn.functional as F
from torch import nn

from .family import LanguageModel, TimeAxis
from .state import Growth, State, StateError, Window, kv_appender, unzip

# appends a layer's new keys and values to its cache, returns all of them (B, S+T, d)
KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin (B, T, 1, hd/2)


def rope_angles(pos: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> Rope:
    """Absolute positions (B, T) -> cos, sin (B, T, 1, hd/2) in `dtype`. Angles are computed
    in float64, so a position gets the same rotation whichever chunk it arrives in, even
    far into a long session."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim)
    ang = pos.to(torch.float64)[..., None] * inv_freq
    return ang.cos()[:, :, None].to(dtype), ang.sin()[:, :, None].to(dtype)


def apply_rope(x: torch.Tensor, cs: Rope, n_head: int) -> torch.Tensor:
    """Rotate each head of x (B, T, n_head*hd) by its position (rotate-half form)."""
    B, T, D = x.shape
    xh = x.view(B, T, n_head, D // n_head)
    x1, x2 = xh.chunk(2, -1)
    cos, sin = cs[0].to(x.dtype), cs[1].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).view(B, T, D)


def window_mask(
    q_idx: torch.Tensor, k_idx: torch.Tensor, span: int, first_valid: torch.Tensor
) -> torch.Tensor:
    """(B, 1, T, K) True where query may attend: 0 <= q - k < span and k is not left padding.

    Indices are positions in one key array [cache; chunk]; first_valid [B] is where each
    row's real entries start (everything before is padding from batching).
    """
    dist = q_idx[:, None] - k_idx[None, :]  # (T, K)
    ok = (dist >= 0) & (dist < span)
    real = k_idx[None, :] >= first_valid[:, None]  # (B, K)
    return (ok[None] & real[:, None])[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, n_head: int
) -> torch.Tensor:
    """q (B, T, D), k, v (B, K, D), allowed (B, 1, T, K) -> (B, T, D)."""
    B, T, D = q.shape
    K = k.shape[1]
    hd = D // n_head
    qh = q.view(B, T, n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
    kh = k.view(B, K, n_head, hd).transpose(1, 2)  # (B, nh, K, hd)
    vh = v.view(B, K, n_head, hd).transpose(1, 2)
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
        allowed: torch.Tensor,  # (B, 1, T, S+T)
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = apply_rope(q, cs, self.n_head), apply_rope(k, cs, self.n_head)
        k, v = kv(k, v)  # (B, S+T, d)
        return self.proj(attend(q, k, v, allowed, self.n_head))


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
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        q = apply_rope(self.q(x), cs, self.n_head)
        return self.proj(attend(q, k, v, allowed, self.n_head))


class MLP(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cs: Rope, kv: KV, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cs, kv, allowed)
        return x + self.mlp(self.norm2(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg)  # sliding window W
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.cross = CrossAttention(cfg)
        self.norm3 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d)
        cs: Rope,
        kv: KV,  # the window cache (B, S, d)
        self_allowed: torch.Tensor,  # (B, 1, T, S+T)
        mem_k: torch.Tensor,  # (B, K, d) this layer's memory group, the entries in reach
        mem_v: torch.Tensor,
        mem_allowed: torch.Tensor,  # (B, 1, T, K)
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cs, kv, self_allowed)
        x = x + self.cross(self.norm2(x), cs, mem_k, mem_v, mem_allowed)
        return x + self.mlp(self.norm3(x))


class Memory(nn.Module):
    """k_t^g = RoPE(W_K^g RMSNorm(e_t), t), v_t^g = W_V^g RMSNorm(e_t), for all G groups."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.G, self.n_head = cfg.memory_groups, cfg.n_head
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.k = nn.Linear(cfg.d_model, self.G * cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, self.G * cfg.d_model, bias=False)

    def forward(self, e: torch.Tensor, cs: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = e.shape
        h = self.norm(e)
        k = apply_rope(self.k(h), cs, self.G * self.n_head)  # (B, T, G*d)
        v = self.v(h)
        return k.view(B, T, self.G, d).transpose(1, 2), v.view(B, T, self.G, d).transpose(
            1, 2
        )  # (B, G, T, d)


class Merge(nn.Module):
    """u_t = e_t + alpha * sigmoid(W_g [e_t; r] + b_g) (.) (W_s r), r = RMSNorm(s_{t-1})."""

    def __init__(self, cfg: RLTConfig):
        super().__init__()
        self.alpha = cfg.alpha
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate = nn.Linear(2 * cfg.d_model, cfg.d_model)  # W_g, b_g
        self.W_s = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, e: torch.Tensor, s_prev: torch.Tensor) -> torch.Tensor:
        r = self.norm(s_prev)
        g = torch.sigmoid(self.gate(torch.cat([e, r], -1)))
        return e + self.alpha * g * self.W_s(r)


# -- the model ----------------------------------------------------------------------------
def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 logits (CUDA autocast) come back as fp32; fp64 (gradient checks) stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RLT(LanguageModel):
    family = "rlt"
    config_class = RLTConfig
    persistent = ("s", "enc_k", "enc_v", "mem_k", "mem_v", "swa_k", "swa_v", "n_tokens")  # all of it

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
        self.norm_out = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)  # W_o
        self.apply(self._init_weights)
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
    def forward(self, tokens: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        if state is None:
            state = self.new_state(B)
        n = state.n_tokens
        pos = n[:, None] + torch.arange(T, device=tokens.device)  # (B, T) absolute positions
        cs = rope_angles(pos, cfg.d_model // cfg.n_head, cfg.rope_base, self.tok_emb.weight.dtype)
        ctx_valid = n.clamp(max=cfg.max_context - 1)  # (B,) real cached encoder / memory entries per row
        in_place = self.grows_in_place()
        grown = {name: state.window(name).grow(T, in_place) for name in ("enc_k", "enc_v", "mem_k", "mem_v")}
        with self.autocast():
            e = self._encode(tokens, cs, grown["enc_k"], grown["enc_v"], ctx_valid)  # (B, T, d)
            mem = self._remember(e, cs, grown["mem_k"], grown["mem_v"])
            s_all, swa = self._recur(e, cs, state, mem, ctx_valid)  # (B, T, d)
            logits = self.head(self.norm_out(s_all))  # (B, T, V)
        windows = {name: g.result(min(cfg.max_context - 1, g.M + T)) for name, g in grown.items()}
        tensors, arenas = unzip({**windows, "swa_k": swa[0], "swa_v": swa[1]})
        tensors["s"] = s_all[:, -1].to(state["s"].dtype)
        tensors["n_tokens"] = n + T
        return _at_least_fp32(logits), self._state(tensors, arenas)

    def _encode(
        self, tokens: torch.Tensor, cs: Rope, ek: Growth, ev: Growth, ctx_valid: torch.Tensor
    ) -> torch.Tensor:
        """The causal encoder, one batch over the chunk: tokens (B, T) -> e (B, T, d)."""
        T, M, dev = tokens.shape[1], ek.M, tokens.device
        # keys [cache (M); chunk (T)]; row b's real cached entries are its last ctx_valid[b]
        allowed = window_mask(
            torch.arange(M, M + T, device=dev), torch.arange(M + T, device=dev), self.config.max_context, M - ctx_valid
        )
        x = self.tok_emb(tokens)  # (B, T, d)
        for i, blk in enumerate(self.encoder):
            x = blk(x, cs, kv_appender(ek, ev, i), allowed)
        return x

    def _remember(
        self, e: torch.Tensor, cs: Rope, gk: Growth, gv: Growth
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Append the chunk's global memory entries: per group, its cached entries then the
        chunk's, k and v (B, Mm+T, d)."""
        mk, mv = self.memory(e, cs)  # (B, G, T, d)
        groups = range(self.config.memory_groups)
        # one tensor per group: a decoder step's gradient then touches one group only
        return [gk.append(g, mk[:, g]) for g in groups], [gv.append(g, mv[:, g]) for g in groups]

    def _recur(
        self,
        e: torch.Tensor,  # (B, T, d) the chunk's encoder outputs
        cs: Rope,
        state: State,
        mem: tuple[list[torch.Tensor], list[torch.Tensor]],
        ctx_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[Window, Window]]:
        """The decoder over the chunk: s_t for every position (B, T, d), and the window caches."""
        n, Mm = state.n_tokens, state["mem_k"].shape[2]
        mem_first = Mm - ctx_valid
        swa = (state.window("swa_k"), state.window("swa_v"))
        if self.merge is None:  # RLT-0: u_t = e_t, the whole chunk at once
            return self._decode(e, 0, cs, swa, mem, Mm, mem_first, n)
        s = state["s"][:, None]  # (B, 1, d) s_{t-1}
        outs = []
        for t in range(e.shape[1]):
            u = self.merge(e[:, t : t + 1], s)  # (B, 1, d)
            cs_t = (cs[0][:, t : t + 1], cs[1][:, t : t + 1])
            s, swa = self._decode(u, t, cs_t, swa, mem, Mm, mem_first, n)
            outs.append(s)
        return torch.cat(outs, 1), swa  # (B, T, d)

    def _decode(
        self,
        x: torch.Tensor,  # (B, T, d) decoder input u for chunk offsets t0 .. t0+T-1
        t0: int,
        cs: Rope,
        swa: tuple[Window, Window],  # the window caches' keys and values (B, L_D, S, d)
        mem: tuple[list[torch.Tensor], list[torch.Tensor]],  # per group k, v (B, Mm+chunk, d)
        Mm: int,  # cached memory entries before the chunk
        mem_first: torch.Tensor,  # (B,) first real memory entry per row
        n: torch.Tensor,  # (B,) tokens before the chunk
    ) -> tuple[torch.Tensor, tuple[Window, Window]]:
        cfg = self.config
        W, C = cfg.window, cfg.max_context
        B, T, _ = x.shape
        dev = x.device
        # sliding-window self-attention: keys [cache (S); these T], row b has min(n+t0, W-1) real cached
        S = swa[0].rows.shape[2]
        self_allowed = window_mask(
            torch.arange(S, S + T, device=dev),
            torch.arange(S + T, device=dev),
            W,
            S - (n + t0).clamp(max=W - 1),
        )
        keep = min(W - 1, S + T)
        # memory prefix: entries j in (t - C, t], i.e. indices [lo, Mm + t0 + T)
        hi = Mm + t0 + T
        lo = max(0, Mm + t0 + 1 - C)
        q_idx = torch.arange(Mm + t0, hi, device=dev)
        mem_allowed = window_mask(q_idx, torch.arange(lo, hi, device=dev), C, mem_first)
        in_place = self.grows_in_place()
        sk, sv = swa[0].grow(T, in_place), swa[1].grow(T, in_place)
        for i, blk in enumerate(self.decoder):
            g = i % cfg.memory_groups
            x = blk(
                x,
                cs,
                kv_appender(sk, sv, i),
                self_allowed,
                mem[0][g][:, lo:hi],
                mem[1][g][:, lo:hi],
                mem_allowed,
            )
        return x, (sk.result(keep), sv.result(keep))

    def next_logits(self, state: State) -> torch.Tensor:
        with self.autocast():
            return _at_least_fp32(self.head(self.norm_out(state["s"])))
