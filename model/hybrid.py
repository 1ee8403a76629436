"""What the hybrid families share: a stack of recurrent layers with a few attention layers
among them, their blocks, their state. Not a family: `model/gdn_hybrid.py` (Gated DeltaNet,
Qwen3.5 / Qwen3-Next) and `model/mamba2_hybrid.py` (Mamba-2, Granite-4.0-H) each give it
their recurrent mixer.

Read top to bottom: config, the attention layer, the block, the model.

The architecture. The config's `pattern` names each layer's mixer, one letter a layer: `r`
a recurrent mixer (`SSMMixer`'s interface, `model/recurrent_mixer.py`: a causal convolution and a
matrix-valued state), `a` grouped-query attention over the stream's stored keys and values
(`model/attention.py`). Every layer is a pre-norm block
    x = x + m * Mixer(RMSNorm(x)),   x = x + m * SwiGLU(RMSNorm(x))
with m = `residual_multiplier`; the embedding is scaled by `embedding_multiplier` and the
logits divided by `logits_scaling` (Granite's muP multipliers; 1 elsewhere). The attention
may gate its output by sigmoid of a second query projection and normalise each head's
queries and keys (Qwen3-Next's gated attention), rotate a part of each head (partial RoPE)
or none (NoPE), and scale its scores by `attn_scale` (0: head_dim^-1/2).

The attention layers' state is a serving option (`attention`):
  * "exact": every key and value, up to `max_context` tokens; a chunk that would pass it
    is refused (`ContextFull`), nothing consumed;
  * "bounded": `sinks` + a `window` of the last positions (StreamingLLM), whatever the
    history, as the LLaMA family keeps its own.
Up to the bound (exact) or to sinks + window + 1 tokens (bounded) the two give the same
results: the model's own.

State (batch-first, every tensor persistent), for Lr recurrent and La attention layers:
  conv            [B, Lr, d_conv-1, C]   each recurrent layer's last conv inputs
  ssm             [B, Lr, ...]           each recurrent layer's matrix state
  k, v            [B, La, M, kvh*hd]     the attention window (exact: M = every token)
  sink_k, sink_v  [B, La, Ms, kvh*hd]    the sinks (bounded only; Ms = 0 when exact)
  last_hidden     [B, d]                 the last position's output (`next_logits`)
  n_tokens        [B]
and a cache, never stored: `next_logits` [B, V]. The recurrent part has one size for ever;
the attention part grows one row per token per attention layer, up to its bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .attention import KV, Pair, Span, attend_stream, kv_axes, next_sinks, span
from .family import ContextFull, Execution, LanguageModel, TimeAxis, init_weights
from .mlp import SwiGLU
from .norms import RMSNorm, rms_norm
from .recurrent_mixer import SSMMixer
from .state import State, StateError, kv_appender, unzip

MODES = ("exact", "bounded")


@dataclass
class HybridConfig:
    vocab_size: int = 258
    d_model: int = 64
    pattern: str = "rrra"  # each layer's mixer: r recurrent, a attention
    d_ff: int = 128  # the SwiGLU MLP's hidden width
    d_conv: int = 4  # the recurrent layers' causal convolution, itself included
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    rope_dim: int = 16  # rotated dimensions of each head (0: no positions)
    rope_base: float = 10000.0
    attn_bias: bool = False
    attn_gate: bool = False  # the output gated by sigmoid(a second query projection)
    qk_norm: bool = False  # each head's queries and keys RMS-normalised
    attn_scale: float = 0.0  # the scores' scale (0: head_dim^-1/2)
    norm_eps: float = 1e-6
    tie_weights: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention: str = "exact"  # the attention layers' state: "exact" or "bounded"
    max_context: int = 4096  # exact: the most tokens a stream may consume
    sinks: int = 4  # bounded: S, the first positions every query attends to
    window: int = 1024  # bounded: W, the previous positions every query attends to
    tgt_len: int = 128  # training segment and serving chunk (results do not depend on it)

    def __post_init__(self) -> None:
        if not self.pattern or set(self.pattern) - {"r", "a"}:
            raise ValueError("pattern names each layer: r (recurrent) or a (attention), e.g. 'rrra'")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError("n_head must be a multiple of n_kv_head")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.head_dim:
            raise ValueError("rope_dim must be even and at most head_dim")
        if self.attention not in MODES:
            raise ValueError(f"attention must be one of {', '.join(MODES)}, not {self.attention!r}")
        if min(self.max_context, self.window, self.tgt_len, self.d_conv) < 1 or self.sinks < 0:
            raise ValueError("max_context, window, tgt_len and d_conv must be >= 1, sinks >= 0")

    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    @property
    def n_attention(self) -> int:
        return self.pattern.count("a")

    @property
    def n_recurrent(self) -> int:
        return self.pattern.count("r")

    @property
    def span_bounds(self) -> tuple[int, int]:
        """(S, W) as `model.attention.span` takes them: exact is a window of every token."""
        return (0, self.max_context) if self.attention == "exact" else (self.sinks, self.window)


# -- the attention layer --------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        H, kvh, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.heads, self.head_dim, self.gated = (H, kvh), hd, cfg.attn_gate
        self.scale = cfg.attn_scale or hd**-0.5
        self.q_proj = nn.Linear(cfg.d_model, H * hd * (2 if cfg.attn_gate else 1), bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, kvh * hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, kvh * hd, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(H * hd, cfg.d_model, bias=cfg.attn_bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None

    def _normed(self, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """x (B, T, heads*hd), each head RMS-normalised where the layer does."""
        if norm is None:
            return x
        return rms_norm(x.unflatten(-1, (-1, self.head_dim)), norm).flatten(-2)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d), already normalised
        span: Span,
        kv: KV,
        sinks: Pair,  # this layer's stored sinks (B, Ms, kvh*hd)
    ) -> tuple[torch.Tensor, Pair]:
        B, T, _ = x.shape
        q, gate = self.q_proj(x), None
        if self.gated:  # per head [q; gate] (HF's layout)
            q, gate = (t.flatten(-2) for t in q.view(B, T, self.heads[0], 2 * self.head_dim).chunk(2, -1))
        q, k = self._normed(q, self.q_norm), self._normed(self.k_proj(x), self.k_norm)
        out, fresh = attend_stream(q * self.scale, k, self.v_proj(x), span, kv, sinks, self.heads)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out), fresh


# -- the block ------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residuals around a mixer (recurrent or attention) and the SwiGLU MLP."""

    def __init__(self, cfg: HybridConfig, mixer: nn.Module):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)


# -- the model ------------------------------------------------------------------------------
class Hybrid(LanguageModel):
    """The hybrid skeleton; a family names its recurrent mixer (`mixer_class`, built from
    the family's config, with `SSMMixer`'s `state_shapes` and `reset_ssm`)."""

    mixer_class: ClassVar[type[SSMMixer]]
    persistent = ("conv", "ssm", "k", "v", "sink_k", "sink_v", "last_hidden", "n_tokens")  # all of it
    serving_options = ("attention", "max_context", "sinks", "window", "tgt_len")

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        mixers = [self.mixer_class(cfg) if kind == "r" else Attention(cfg) for kind in cfg.pattern]
        self.layers = nn.ModuleList(Block(cfg, m) for m in mixers)
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_weights)
        for m in mixers:
            if isinstance(m, SSMMixer):
                m.reset_ssm()
            # the residual branches' outputs, scaled for depth (GPT-2's)
            out = m.out_proj if isinstance(m, SSMMixer) else m.o_proj
            nn.init.normal_(out.weight, 0.0, 0.02 / math.sqrt(cfg.n_layer))
        if cfg.tie_weights:
            self.head.weight = self.embed.weight

    def blocks(self) -> list[Block]:
        return list(self.layers)  # type: ignore[arg-type]

    @property
    def context_window(self) -> int:
        S, W = self.config.span_bounds
        return S + W + (self.config.attention == "bounded")

    # -- state ------------------------------------------------------------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        cfg = self.config
        S, W = cfg.span_bounds
        return kv_axes(cfg.n_attention, cfg.n_kv_head * cfg.head_dim, S, W)

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        channels, ssm = self.mixer_class.state_shapes(cfg)
        return {
            "conv": (cfg.n_recurrent, cfg.d_conv - 1, channels),
            "ssm": (cfg.n_recurrent, *ssm),
            "last_hidden": (cfg.d_model,),
        }

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
    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        n = state.n_tokens
        if cfg.attention == "exact" and int(n.max()) + T > cfg.max_context:
            raise ContextFull(
                f"this stream has consumed {int(n.max())} tokens and {T} more would pass the "
                f"{cfg.max_context} that exact attention keeps (serve with attention=bounded, or a "
                "larger max_context)"
            )
        S, W = cfg.span_bounds
        M, Ms = state["k"].shape[2], state["sink_k"].shape[2]
        rope = (cfg.rope_dim, cfg.rope_base) if cfg.rope_dim else None
        sp = span(n, T, M, Ms, S, W, rope, self.embed.weight.dtype)
        grown = {name: state.window(name).grow(T, how.in_place) for name in ("k", "v")}
        with self.autocast():
            x = self.embed(tokens) * cfg.embedding_multiplier  # (B, T, d)
            x, recurrent, fresh = self._layers(x, state, sp, grown)
            logits = self.head(rms_norm(how.logit_rows(x), self.norm_out)) / cfg.logits_scaling  # (B, T or 1, V)
        tensors, arenas = unzip({name: g.result(min(W, M + T)) for name, g in grown.items()})
        tensors.update(recurrent)
        tensors["sink_k"], tensors["sink_v"] = next_sinks((state["sink_k"], state["sink_v"]), fresh, n, S, T)
        tensors["last_hidden"] = x[:, -1].to(state["last_hidden"].dtype)
        tensors["n_tokens"] = n + T
        logits = logits.float()
        tensors["next_logits"] = logits[:, -1].clone() if logits.shape[1] > 1 else logits[:, 0]
        return logits, self._state(tensors, arenas)

    def _layers(
        self, x: torch.Tensor, state: State, sp: Span, grown: dict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Pair]]:
        """Every block over x (B, T, d): the output, the recurrent layers' new conv windows
        and states, and the attention layers' fresh rows (the sink candidates)."""
        m = self.config.residual_multiplier
        conv, ssm = state["conv"], state["ssm"]
        windows: list[torch.Tensor] = []
        hs: list[torch.Tensor] = []
        fresh: list[Pair] = []
        for blk in self.blocks():
            u = rms_norm(x, blk.norm1)
            if isinstance(blk.mixer, Attention):
                j = len(fresh)
                sinks = (state["sink_k"][:, j], state["sink_v"][:, j])
                out, new = blk.mixer(u, sp, kv_appender(grown["k"], grown["v"], j), sinks)
                fresh.append(new)
            else:
                r = len(hs)
                out, window, h = blk.mixer(u, conv[:, r], ssm[:, r])
                windows.append(window.to(conv.dtype))
                hs.append(h.to(ssm.dtype))
            x = x + out * m
            x = x + blk.mlp(rms_norm(x, blk.norm2)) * m
        recurrent = {
            "conv": torch.stack(windows, 1) if windows else conv,
            "ssm": torch.stack(hs, 1) if hs else ssm,
        }
        return x, recurrent, fresh

    def next_logits(self, state: State) -> torch.Tensor:
        cached = state.tensors.get("next_logits")
        if cached is not None:
            return cached
        with self.autocast():
            return (
                self.head(rms_norm(state["last_hidden"], self.norm_out)) / self.config.logits_scaling
            ).float()
