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

from .family import LanguageModel
from .state import Arena, State, StateError, Window, kv_appender, unzip

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


STATE_NAMES = ("s", "enc_k", "enc_v", "mem_k", "mem_v", "swa_k", "swa_v", "n_tokens")


class RLT(LanguageModel):
    family = "rlt"
    config_class = RLTConfig

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

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    # -- state ----------------------------------------------------------------------------
    def _state(self, tensors: dict[str, torch.Tensor], arenas: dict[str, Arena] | None = None) -> State:
        seq = {name: 2 for name in ("enc_k", "enc_v", "mem_k", "mem_v", "swa_k", "swa_v")}
        return State(
            self.family, self.fingerprint, tensors, seq_dims=seq, persistent=STATE_NAMES, arenas=arenas or {}
        )

    def new_state(self, batch_size: int = 1) -> State:
        cfg, dev = self.config, self.device
        dtype = next(self.parameters()).dtype
        d = cfg.d_model

        def empty(layers: int) -> torch.Tensor:
            return torch.zeros(batch_size, layers, 0, d, device=dev, dtype=dtype)

        s0 = self.s_star.expand(batch_size, d)  # training: gradients reach s*
        if not (self.training and torch.is_grad_enabled()):
            s0 = s0.detach().clone()
        return self._state(
            {
                "s": s0,
                "enc_k": empty(cfg.n_encoder_layers),
                "enc_v": empty(cfg.n_encoder_layers),
                "mem_k": empty(cfg.memory_groups),
                "mem_v": empty(cfg.memory_groups),
                "swa_k": empty(cfg.n_decoder_layers),
                "swa_v": empty(cfg.n_decoder_layers),
                "n_tokens": torch.zeros(batch_size, dtype=torch.long, device=dev),
            }
        )

    def state_lengths(self, state: State) -> dict[str, torch.Tensor]:
        cfg, n = self.config, state.n_tokens
        ctx, win = n.clamp(max=cfg.max_context - 1), n.clamp(max=cfg.window - 1)
        return {"enc_k": ctx, "enc_v": ctx, "mem_k": ctx, "mem_v": ctx, "swa_k": win, "swa_v": win}

    def check_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        if set(tensors) != set(STATE_NAMES):
            raise StateError(f"state holds tensors {sorted(tensors)}, expected {sorted(STATE_NAMES)}")
        n = tensors["n_tokens"]
        if n.dim() != 1 or n.dtype != torch.long or (n < 0).any():
            raise StateError("state n_tokens must be a non-negative int64 vector")
        B = n.shape[0]
        if B < 1:
            raise StateError("state has an empty batch")
        s = tensors["s"]
        if not s.is_floating_point() or list(s.shape) != [B, cfg.d_model]:
            raise StateError(f"state s has shape {list(s.shape)}, expected [{B}, {cfg.d_model}]")
        spans = {
            "enc": (cfg.n_encoder_layers, cfg.max_context - 1),
            "mem": (cfg.memory_groups, cfg.max_context - 1),
            "swa": (cfg.n_decoder_layers, cfg.window - 1),
        }
        for prefix, (layers, bound) in spans.items():
            k, v = tensors[prefix + "_k"], tensors[prefix + "_v"]
            if k.shape != v.shape:
                raise StateError(f"state {prefix}_k and {prefix}_v differ in shape")
            if not k.is_floating_point() or not v.is_floating_point():
                raise StateError(f"state {prefix}_k/v must be floating point")
            if k.dim() != 4 or k.shape[0] != B or k.shape[1] != layers or k.shape[3] != cfg.d_model:
                raise StateError(
                    f"state {prefix}_k has shape {list(k.shape)}, expected [{B}, {layers}, M, {cfg.d_model}]"
                )
            if k.shape[2] > bound or k.shape[2] < int(n.clamp(max=bound).max()):
                raise StateError(
                    f"state {prefix} length {k.shape[2]} does not fit bound {bound} and n_tokens"
                )
        if not all(torch.isfinite(t).all() for name, t in tensors.items() if name != "n_tokens"):
            raise StateError("state holds non-finite values")

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        return self._state(dict(tensors))  # every tensor is persistent: nothing to recompute

    # -- forward --------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        if state is None:
            state = self.new_state(B)
        n = state.n_tokens
        C = cfg.max_context
        dev = tokens.device
        pos = n[:, None] + torch.arange(T, device=dev)  # (B, T) absolute positions
        cs = rope_angles(pos, cfg.d_model // cfg.n_head, cfg.rope_base, self.tok_emb.weight.dtype)
        ctx_valid = n.clamp(max=C - 1)  # (B,) real cached encoder / memory entries per row
        in_place = self.grows_in_place()
        with self.autocast():
            # causal encoder, one batch over the chunk
            M = state["enc_k"].shape[2]
            allowed = window_mask(
                torch.arange(M, M + T, device=dev), torch.arange(M + T, device=dev), C, M - ctx_valid
            )
            x = self.tok_emb(tokens)  # (B, T, d)
            keep = min(C - 1, M + T)
            ek, ev = state.window("enc_k").grow(T, in_place), state.window("enc_v").grow(T, in_place)
            for i, blk in enumerate(self.encoder):
                x = blk(x, cs, kv_appender(ek, ev, i), allowed)
            e = x  # (B, T, d)

            # global KV memory: cached entries then this chunk's
            mk, mv = self.memory(e, cs)  # (B, G, T, d)
            Mm = state["mem_k"].shape[2]
            gk, gv = state.window("mem_k").grow(T, in_place), state.window("mem_v").grow(T, in_place)
            # one tensor per group (B, Mm+T, d): a decoder step's gradient then touches one group only
            mem = (
                [gk.append(g, mk[:, g]) for g in range(cfg.memory_groups)],
                [gv.append(g, mv[:, g]) for g in range(cfg.memory_groups)],
            )
            swa = (state.window("swa_k"), state.window("swa_v"))
            mem_first = Mm - ctx_valid
            if self.merge is None:  # RLT-0: u_t = e_t, the whole chunk at once
                s_all, swa = self._decode(e, 0, cs, swa, mem, Mm, mem_first, n)
            else:
                s = state["s"][:, None]  # (B, 1, d) s_{t-1}
                outs = []
                for t in range(T):
                    u = self.merge(e[:, t : t + 1], s)  # (B, 1, d)
                    cs_t = (cs[0][:, t : t + 1], cs[1][:, t : t + 1])
                    s, swa = self._decode(u, t, cs_t, swa, mem, Mm, mem_first, n)
                    outs.append(s)
                s_all = torch.cat(outs, 1)  # (B, T, d)
            logits = self.head(self.norm_out(s_all))  # (B, T, V)

        tensors, arenas = unzip(
            {
                "enc_k": ek.result(keep),
                "enc_v": ev.result(keep),
                "mem_k": gk.result(min(C - 1, Mm + T)),
                "mem_v": gv.result(min(C - 1, Mm + T)),
                "swa_k": swa[0],
                "swa_v": swa[1],
            }
        )
        tensors["s"] = s_all[:, -1].to(state["s"].dtype)
        tensors["n_tokens"] = n + T
        return _at_least_fp32(logits), self._state(tensors, arenas)

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
