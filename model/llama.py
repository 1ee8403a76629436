"""Decoder-only LLaMA-architecture transformers (LLaMA, Mistral, SmolLM2, ...) served as a
bounded recurrent state: S attention sinks and a sliding window of W positions
(StreamingLLM, Xiao et al., ICLR 2024).

Read top to bottom: config, attention, blocks, the model. The positions, masks and the
attention over the stored keys and values are `model/attention.py`'s, shared with the hybrids.

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
(`model.rotary.rope_angles`), so a key millions of tokens deep is rotated as exactly as the
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
At a state precision below float32 (`set_state_dtype`: bfloat16, int8) every key and value
is rounded as it is appended, and every query, its own chunk's included, attends to the
rounded rows, which are the sinks too (`model.state.precision`). Early in a stream a
position can be both in the window and a sink: the window part masks it. Rows shorter than the batch's longest are left-padded; a key's position (negative for
padding) decides every mask. The state is bounded, 2 L (S + W) kvh hd + d floats, whatever
the history, and a token's results never depend on where chunk or request boundaries fell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .attention import KV, Pair, Span, attend_stream, kv_axes, next_sinks, span
from .family import Execution, LanguageModel, TimeAxis, init_weights
from .int4 import int4_linear
from .int8 import Int8Blocks, Int8Embedding, Int8Head, int8_linear, quantize_blocks
from .mlp import SwiGLU
from .norms import RMSNorm, rms_norm
from .state import State, StateError, kv_appender, unzip
from .state.precision import PRECISIONS

DEFAULT_SINKS = 4  # StreamingLLM's choice: four initial tokens hold the attention sink
DEFAULT_WINDOW = 1024  # the W a checkpoint gets unless it was trained with a window (docs/MODEL_CARD.md)
FP32_U = 2.0**-24  # fp32's unit roundoff
BF16_STEP = 2.0**-7  # bfloat16's largest relative step between neighbours (8 significant bits)


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


# A layer's weights under the family's names, each from the parts (joined in this order) a
# checkpoint names its own way: model/llama_hf.py's HF_PARTS, model/llama_gguf.py's GGUF_PARTS.
LAYER = {
    "attn.qkv": ("q", "k", "v"),
    "attn.proj": ("o",),
    "mlp.gate_up": ("gate", "up"),
    "mlp.down": ("down",),
    "norm1": ("norm1",),
    "norm2": ("norm2",),
}


def layer_weights(prefix: str, part: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's weights under the family's names (`prefix` + LAYER's), `part(name)` giving
    the reader's tensor for each of LAYER's parts."""
    out = {}
    for name, parts in LAYER.items():
        tensors = [part(x) for x in parts]
        out[prefix + name + ".weight"] = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
    return out


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # nn.Linear, or its int8 or int4 form (`Llama.quantize`)
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
        out, fresh = attend_stream(q * hd**-0.5, k, v, span, kv, sinks, (H, kvh))
        return self.proj(out), fresh


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

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
    cache_precisions = PRECISIONS  # k, v and the sinks, rounded as appended (`model.state.precision`)

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        cfg = config
        self.tok_emb: nn.Module = nn.Embedding(cfg.vocab_size, cfg.d_model)  # or `Int8Embedding`
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

    def quantize(self, precision: str = "int8") -> None:
        """Every block's linear layers (q, k, v; the attention's output; the MLP) in int8
        (`model/int8.py`) or int4 (`model/int4.py`), with bfloat16 activations into their
        kernels; the head and the token lookup int8 in blocks of 32 either way (`Int8Head`:
        the head sets every logit, so its largest are recomputed from the blocks). A head
        tied to the embedding keeps one table, which the token lookup reads too."""
        if precision not in ("int8", "int4"):
            raise ValueError(f"no packed {precision!r} weights: int8 or int4")
        if self.device.type != "cpu":
            raise ValueError(f"{precision} weights are a CPU path: serve on CUDA in bf16 or fp32")
        linear: Callable[[nn.Module], nn.Module] = int8_linear if precision == "int8" else int4_linear
        for blk in self.blocks():
            blk.attn.qkv, blk.attn.proj = linear(blk.attn.qkv), linear(blk.attn.proj)
            blk.mlp.gate_up, blk.mlp.down = linear(blk.mlp.gate_up), linear(blk.mlp.down)
        emb, head = self.tok_emb, self.head
        assert isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear)
        table = None if self.config.tie_weights else Int8Blocks(*quantize_blocks(emb.weight))
        self.set_packed_ends(Int8Blocks(*quantize_blocks(head.weight)), table)
        self.precision = precision

    def logit_rtol(self) -> float:
        """Two evaluations of a step that differ only in the order of their sums (a compiled
        step against the eager one) differ, relative to the scale of what they sum, by up
        to gamma_n = n u for a reduction of n terms (Higham, *Accuracy and Stability of
        Numerical Algorithms*, 3.1; u = 2^-24 in fp32). n is the step's longest reduction
        (the MLP's hidden width, the attended positions or the model's width), and the
        largest |logit| stands for the scale: smollm2's n is 1,536, so 9.2e-5 of it, about
        2.7e-3 at logits near 30, where its compiled step measured 2.7e-4. Where the
        activations are rounded to bfloat16 (the packed weights' kernels, bf16 autocast) or
        the caches are (or to float16, whose step is finer), a last-bit difference before a
        rounding moves the rounded value by a whole step, and so on up to the logits: one
        bfloat16 step of the largest logit, 2^-7 of it. A state at int8 rounds to a coarser
        grid: no allowance."""
        cfg = self.config
        if self.precision != "fp32" or self.state_precision in ("bfloat16", "float16"):
            return BF16_STEP
        if self.state_precision != "float32":
            return 0.0
        n = max(cfg.d_model, cfg.d_ff, cfg.n_head * cfg.head_dim, cfg.sinks + cfg.window + 1)
        return n * FP32_U

    def set_packed_ends(self, head: Int8Blocks, embedding: Int8Blocks | None = None) -> None:
        """The head's table (`Int8Head`), and the token lookup's: `embedding`, or the head's
        when tied."""
        self.head = Int8Head(head)
        table = head if self.config.tie_weights or embedding is None else embedding
        self.tok_emb = Int8Embedding(table)

    # -- state ------------------------------------------------------------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        cfg = self.config
        return kv_axes(cfg.n_layer, cfg.n_kv_head * cfg.head_dim, cfg.sinks, cfg.window)

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"last_hidden": (self.config.d_model,)}

    def batch_layouts(self) -> dict[str, bool]:
        return {"k": False, "v": False}  # `advance` grows the window in place; the sinks fill apart

    def readied_layouts(self) -> dict[str, bool]:
        return self.batch_layouts()  # a compiled step appends to the window in place too

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
        window rows and Ms stored sinks (`model.attention.span`)."""
        cfg = self.config
        rope = (cfg.head_dim, cfg.rope_base)
        return span(n, T, M, Ms, cfg.sinks, cfg.window, rope, self.norm_out.weight.dtype)

    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        n = state.n_tokens
        M, Ms = state["k"].shape[2], state["sink_k"].shape[2]
        span = self.span(n, T, M, Ms)
        grown = {
            name: state.window(name).grow(T, how.in_place, readied=how.readied.get(name))
            for name in ("k", "v")
        }
        fresh: list[Pair] = []
        with self.autocast():
            x = self.tok_emb(tokens)  # (B, T, d)
            for i, blk in enumerate(self.blocks()):
                kv = kv_appender(grown["k"], grown["v"], i)
                x, new = blk(x, span, kv, (state["sink_k"][:, i], state["sink_v"][:, i]))
                fresh.append(new)
            logits = self.head(rms_norm(how.logit_rows(x), self.norm_out))  # (B, T or 1, V)
        dtype = state["k"].dtype
        tensors, arenas = unzip({name: g.result(min(cfg.window, M + T)) for name, g in grown.items()})
        old = (state["sink_k"], state["sink_v"])
        tensors["sink_k"], tensors["sink_v"] = next_sinks(old, fresh, n, cfg.sinks, T)
        tensors["last_hidden"] = x[:, -1].to(dtype)
        tensors["n_tokens"] = n + T
        logits = logits.float()
        tensors["next_logits"] = logits[:, -1].clone() if logits.shape[1] > 1 else logits[:, 0]
        return logits, self._state(tensors, arenas)

    def next_logits(self, state: State) -> torch.Tensor:
        cached = state.tensors.get("next_logits")
        if cached is not None:
            return cached
        with self.autocast():
            return self.head(rms_norm(state["last_hidden"], self.norm_out)).float()
