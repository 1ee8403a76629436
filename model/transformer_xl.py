"""Transformer-XL (Dai et al., 2019): relative-position attention over a recurrent memory.

Read top to bottom: config, attention, feed-forward, block, model.

Two attention modes (config.attention):
  * "window" (default): every query attends to itself and exactly the previous `mem_len`
    positions, at every layer. A position's hidden state then depends only on its
    window, never on where segment boundaries fell, so a stream fed in one call, in any
    chunking, or token by token gives the same logits. This generalises the paper's
    `same_length` evaluation mode to every segment.
  * "segment": the paper's training-time attention: a query sees the whole memory plus
    its own segment up to itself, so results depend on the segmentation. Kept for
    pretrained checkpoints, which were trained this way.

Memory (Sec. 3.2): each layer keeps the last `mem_len` hidden states of its *input*,
detached (StopGrad, Eq. h~ = [SG(m); h]). At a state precision below float32
(`set_state_dtype`) each row is rounded as it is appended (`model.state.precision`), and
its keys and values are projected from the rounded row, in its own chunk too. At inference the layer's keys and values for
the memory rows are also cached in the state, so a decode step projects one new row
instead of re-projecting the whole memory; the cache is derived data and is rebuilt from
the memory when a state is loaded from bytes. A decode step (one new token per stream, at
inference) runs `RelPartialLearnableMultiHeadAttn.step`, the same attention arranged for a
step bound by memory bandwidth: no relative shift, the position table sliced, and every
stream's cache kept time-major (`model.state.Arena`) so its scores scan contiguous rows.

Pretrained checkpoints (the original / HF `TransfoXLLMHeadModel` layout, see model/hf.py)
add three options, all off by default so native checkpoints are untouched:
  * `adaptive`: the adaptive input embedding and the projected adaptive log-softmax
    (Baevski & Auli, 2019; Grave et al., 2017) over `cutoffs` with `div_val`, their
    weights and projections tied (`tie_weights`, `tie_projs`); parameter names mirror
    the original so conversion is a key rename;
  * `same_length` (segment mode): every query sees exactly the last `mem_len` positions,
    itself included (the paper's evaluation mode). It makes results chunking-invariant
    too, with a window one shorter than "window" mode's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from .family import Execution, LanguageModel, TimeAxis, init_weights
from .state import Growth, State, kv_appender, unzip
from .state.precision import PRECISIONS


@dataclass
class TransformerXLConfig:
    vocab_size: int = 258  # UTF-8 bytes, <bos>, <eos> (`model.tokenizer.ByteTokenizer`)
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_head: int = 32  # per head; n_head * d_head need not equal d_model
    d_inner: int = 512  # the feed-forward's hidden width
    mem_len: int = 128  # M: hidden states each layer remembers (Sec. 3.2)
    tgt_len: int = 128  # training segment length; also the serving chunk size
    clamp_len: int = 0  # > 0: relative distances beyond it share one embedding
    pre_lnorm: bool = False
    final_norm: bool = False  # a LayerNorm before the head (useful with pre_lnorm)
    dropout: float = 0.1
    dropatt: float = 0.0
    attention: str = "window"  # "window" | "segment"
    untie_r: bool = True  # per-layer u, v biases (else one pair shared by all layers)
    tie_weights: bool = True
    layer_norm_epsilon: float = 1e-5
    # pretrained checkpoints only (see the module docstring); defaults = the native model
    adaptive: bool = False  # adaptive input embedding + projected adaptive log-softmax
    d_embed: int = 0  # embedding width of the first cluster (0: d_model)
    cutoffs: list[int] = field(default_factory=list)  # cluster boundaries in the vocabulary
    div_val: int = 1  # cluster i embeds in d_embed // div_val**i dimensions
    tie_projs: list[bool] = field(default_factory=list)  # per cluster: share the input projection
    same_length: bool = False  # segment mode: every query sees exactly mem_len positions

    def __post_init__(self) -> None:
        if self.attention not in ("window", "segment"):
            raise ValueError(f"attention must be 'window' or 'segment', not {self.attention!r}")
        if self.mem_len < 0 or self.tgt_len < 1:
            raise ValueError("mem_len must be >= 0 and tgt_len >= 1")
        if self.same_length and (self.attention != "segment" or self.mem_len < 1):
            raise ValueError("same_length needs attention='segment' and mem_len >= 1")
        if (self.cutoffs or self.div_val != 1 or self.d_embed or self.tie_projs) and not self.adaptive:
            raise ValueError("cutoffs, div_val, d_embed and tie_projs need adaptive=True")
        if self.adaptive:
            if list(self.cutoffs) != sorted(set(self.cutoffs)) or any(
                not 0 < c < self.vocab_size for c in self.cutoffs
            ):
                raise ValueError(f"cutoffs must increase strictly inside (0, vocab_size): {self.cutoffs}")
            if self.div_val < 1:
                raise ValueError("div_val must be >= 1")
            if self.tie_projs and len(self.tie_projs) != len(self.cutoffs) + 1:
                raise ValueError("tie_projs needs one entry per cluster (len(cutoffs) + 1)")


# Config fields that are omitted from a checkpoint's config (and its fingerprint) while
# they hold their defaults, so native checkpoints read and hash exactly as before.
PRETRAINED_DEFAULTS: dict[str, object] = {
    "adaptive": False,
    "d_embed": 0,
    "cutoffs": [],
    "div_val": 1,
    "tie_projs": [],
    "same_length": False,
}


def sinusoid(pos_seq: torch.Tensor, d_model: int) -> torch.Tensor:
    """Sinusoidal embeddings R of relative distances (Sec. 3.3): [K] -> [K, d_model]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=pos_seq.device) / d_model))
    angles = torch.outer(pos_seq.float(), inv_freq)
    return torch.cat([angles.sin(), angles.cos()], -1)


@dataclass
class PositionTables:
    """Inference cache: per layer W_{k,R} R over the distances P-1 .. 0, in that order and
    one distance per column (H*dh, P), so that the last K columns serve any K <= P as a
    slice (no gather per step) and a decode step scans contiguous rows."""

    rk: list[torch.Tensor]

    def keys(self, layer: int, K: int, n_head: int) -> torch.Tensor:
        """W_{k,R} R for distances K-1 .. 0, one per row: a view (K, H, dh)."""
        return self.rk[layer][:, -K:].t().view(K, n_head, -1)


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """The paper's vectorised relative shift (Appendix B).

    In: x[b, h, i, c] scored against relative distance K-1-c, for queries i of the last
    T of K key positions. Out: y[b, h, i, j] scored against distance (K-T) + i - j, i.e.
    the true distance from query i to key j. Entries with j beyond the query are junk
    and must be masked by the caller.
    """
    B, H, T, K = x.shape
    padded = torch.cat([x.new_zeros(B, H, T, 1), x], -1).view(B, H, K + 1, T)
    return padded[:, :, 1:].reshape(B, H, T, K)


# appends a layer's new keys and values to its cache, returns all of them (B, M+T, H*dh)
KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attend_one(
    q: torch.Tensor,  # (B, H, dh) one query per stream, content bias u added
    k: torch.Tensor,  # (B, K, H*dh) keys as the cache holds them
    v: torch.Tensor,  # (B, K, H*dh)
    bias: torch.Tensor,  # (B, H, K) the position scores (b) + (d), unscaled
    mask: torch.Tensor | None,  # (B, 1, K) True = may not attend
    scale: float,
) -> torch.Tensor:
    """softmax(scale * (q k^T + bias)) v for one query per stream -> (B, H, dh).

    The (stream, head) pairs are the batch of two matrix-vector products that read each
    cached key and value once, where it lies: in a time-major arena (`model.state.Arena`,
    every decode step's) a pair's keys are dh rows of K contiguous values, and the
    streams' and heads' rows are equally spaced, so both reshapes below are views. The
    position term goes in as the scores' starting value (one pass, no separate mask)."""
    B, H, dh = q.shape
    K = k.shape[1]
    kt = k.transpose(1, 2).reshape(B * H, dh, K)  # (B*H, dh, K)
    vt = v.transpose(1, 2).reshape(B * H, dh, K)
    s = torch.baddbmm(bias.reshape(B * H, 1, K), q.reshape(B * H, 1, dh), kt, beta=scale, alpha=scale)
    if mask is not None:
        s = s.view(B, H, K).masked_fill(mask, float("-inf")).view(B * H, 1, K)
    out = torch.bmm(s.softmax(-1), vt.transpose(1, 2))  # (B*H, 1, dh)
    return out.view(B, H, dh)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        H, dh, d = cfg.n_head, cfg.d_head, cfg.d_model
        self.n_head, self.d_head, self.pre_lnorm = H, dh, cfg.pre_lnorm
        self.qkv_net = nn.Linear(d, 3 * H * dh, bias=False)
        self.r_net = nn.Linear(d, H * dh, bias=False)  # W_{k,R}
        self.o_net = nn.Linear(H * dh, d, bias=False)
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon)
        self.drop = nn.Dropout(cfg.dropout)
        self.dropatt = nn.Dropout(cfg.dropatt)
        self.scale = 1.0 / math.sqrt(dh)
        if cfg.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(H, dh))  # u
            self.r_r_bias = nn.Parameter(torch.zeros(H, dh))  # v

    def project_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for memory rows [B, M, d] -> 2 x [B, M, H*dh]."""
        x = self.layer_norm(rows) if self.pre_lnorm else rows
        _, k, v = self.qkv_net(x).chunk(3, -1)
        return k, v

    def forward(
        self,
        h: torch.Tensor,  # (B, T, d) this layer's input for the new tokens
        mem: torch.Tensor,  # (B, M, d) SG(memory), used when no kv cache is given
        rk: torch.Tensor,  # (K, H, dh) W_{k,R} R for distances K-1 .. 0
        mask: torch.Tensor | None,  # (B, T, K) True = may not attend; None: every key
        u: torch.Tensor,
        v_bias: torch.Tensor,
        kv: KV | None,
        stored: torch.Tensor | None = None,  # (B, T, d) h as the memory keeps it, if rounded
    ) -> torch.Tensor:
        """`kv(k_new, v_new)` appends the new keys and values to the cached ones and returns
        all of them (B, M+T, H*dh); without it (training) memory is projected afresh. Where
        the memory keeps h rounded (a state precision below float32), the new keys and values
        are projected from the rounded rows, as a state loaded from bytes projects them."""
        B, T, _ = h.shape
        H, dh = self.n_head, self.d_head
        if kv is None:
            cat = torch.cat([mem, h], 1)
            x = self.layer_norm(cat) if self.pre_lnorm else cat
            q, k, v = self.qkv_net(x).chunk(3, -1)
            q = q[:, -T:]
        else:
            x = self.layer_norm(h) if self.pre_lnorm else h
            q, k_new, v_new = self.qkv_net(x).chunk(3, -1)
            if stored is not None:
                k_new, v_new = self.project_kv(stored)
            k, v = kv(k_new, v_new)
        K = k.shape[1]
        qh = q.reshape(B, T, H, dh)
        # Eq. (after 3.3): A = (a) + (c) content terms with global bias u,
        #                      (b) + (d) position terms with global bias v
        # (b) + (d) and the mask go in as an additive bias, so the fused attention kernel
        # computes (a) + (c), the softmax and the weighted sum, reading the cached keys and
        # values where they lie (strided views: no copy of the cache per step)
        bd = rel_shift(torch.einsum("bihd,jhd->bhij", qh + v_bias, rk))  # (B, H, T, K)
        bias = bd * self.scale
        if mask is not None:
            bias = bias.masked_fill(mask[:, None], float("-inf"))
        out = F.scaled_dot_product_attention(
            (qh + u).transpose(1, 2),  # (B, H, T, dh)
            k.view(B, K, H, dh).transpose(1, 2),  # (B, H, K, dh)
            v.view(B, K, H, dh).transpose(1, 2),
            attn_mask=bias.to(q.dtype),
            dropout_p=self.dropatt.p if self.training else 0.0,
            scale=self.scale,
        )  # (B, H, T, dh)
        out = self.drop(self.o_net(out.transpose(1, 2).reshape(B, T, H * dh)))
        return h + out if self.pre_lnorm else self.layer_norm(h + out)

    def step(
        self,
        h: torch.Tensor,  # (B, 1, d) this layer's input for one new token per stream
        rk: torch.Tensor,  # (H*dh, K) W_{k,R} R for distances K-1 .. 0, one per column
        mask: torch.Tensor | None,  # (B, 1, K) True = may not attend; None: every key
        u: torch.Tensor,
        v_bias: torch.Tensor,
        kv: KV,
        stored: torch.Tensor | None = None,  # (B, 1, d) h as the memory keeps it, if rounded
    ) -> torch.Tensor:
        """`forward` for one new token per stream (inference): no relative shift (the one
        query's distances are the keys' order reversed), and every read of the cache and
        the position table is in place."""
        B = h.shape[0]
        H, dh = self.n_head, self.d_head
        x = self.layer_norm(h) if self.pre_lnorm else h
        q, k_new, v_new = self.qkv_net(x).chunk(3, -1)  # (B, 1, H*dh)
        if stored is not None:
            k_new, v_new = self.project_kv(stored)
        k, v = kv(k_new, v_new)  # (B, K, H*dh)
        qh = q.view(B, H, dh)
        bd = torch.bmm((qh + v_bias).transpose(0, 1), rk.view(H, dh, -1)).transpose(0, 1)  # (B, H, K)
        out = attend_one(qh + u, k, v, bd, mask, self.scale)  # (B, H, dh)
        out = self.o_net(out.reshape(B, 1, H * dh))
        return h + out if self.pre_lnorm else self.layer_norm(h + out)


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.pre_lnorm = cfg.pre_lnorm
        self.CoreNet = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner),
            nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            return h + self.CoreNet(self.layer_norm(h))
        return self.layer_norm(h + self.CoreNet(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(cfg)
        self.pos_ff = PositionwiseFF(cfg)


class AdaptiveEmbedding(nn.Module):
    """Adaptive input embedding (Baevski & Auli, 2019), as in the original code.

    The vocabulary is cut into clusters at `cutoffs`; cluster i embeds its tokens in
    d_embed // div_val**i dimensions and projects them to d_model. With div_val == 1 there
    is one table, projected only when d_embed != d_model.
    """

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        d_embed = cfg.d_embed or cfg.d_model
        self.div_val = cfg.div_val
        self.bounds = [0, *cfg.cutoffs, cfg.vocab_size]
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if cfg.div_val == 1:
            self.emb_layers.append(nn.Embedding(cfg.vocab_size, d_embed))
            if d_embed != cfg.d_model:
                self.emb_projs.append(nn.Parameter(torch.zeros(cfg.d_model, d_embed)))
        else:
            for i, (lo, hi) in enumerate(pairwise(self.bounds)):
                d_i = d_embed // cfg.div_val**i
                self.emb_layers.append(nn.Embedding(hi - lo, d_i))
                self.emb_projs.append(nn.Parameter(torch.zeros(cfg.d_model, d_i)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d_model)
        if self.div_val == 1:
            emb = self.emb_layers[0](tokens)
            return F.linear(emb, self.emb_projs[0]) if len(self.emb_projs) else emb
        # every cluster embeds every token (clamped into its range) and each token keeps its
        # own cluster's row: no data-dependent shapes, so no host sync in a decode step
        out = torch.empty(0)
        for i, (lo, hi) in enumerate(pairwise(self.bounds)):
            emb = F.linear(self.emb_layers[i]((tokens - lo).clamp(0, hi - lo - 1)), self.emb_projs[i])
            out = emb if i == 0 else torch.where(((tokens >= lo) & (tokens < hi))[..., None], emb, out)
        return out


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """The original code's projected adaptive softmax (Grave et al., 2017), full log-probs.

    The head scores the first cluster's tokens plus one logit per tail cluster; a tail
    token's log-prob is log p(cluster) + log p(token | cluster). Hidden states are
    projected per cluster (out_projs) before the output layers. Its output is a
    normalised log-distribution, which serves as logits.
    """

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        d_embed, V = cfg.d_embed or cfg.d_model, cfg.vocab_size
        self.div_val = cfg.div_val
        self.bounds = [0, *cfg.cutoffs, V]
        n_clusters = len(cfg.cutoffs)
        if n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if cfg.div_val == 1:
            self.out_layers.append(nn.Linear(d_embed, V))
            if d_embed != cfg.d_model:
                for _ in range(n_clusters + 1):
                    self.out_projs.append(nn.Parameter(torch.zeros(cfg.d_model, d_embed)))
        else:
            for i, (lo, hi) in enumerate(pairwise(self.bounds)):
                d_i = d_embed // cfg.div_val**i
                self.out_projs.append(nn.Parameter(torch.zeros(cfg.d_model, d_i)))
                self.out_layers.append(nn.Linear(d_i, hi - lo))

    def _logits(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Cluster i's logits (the head's include the tail-cluster logits)."""
        layer = self.out_layers[0 if self.div_val == 1 else i]
        assert isinstance(layer, nn.Linear)
        w: torch.Tensor = layer.weight
        b: torch.Tensor = layer.bias
        if self.div_val == 1:  # one layer over the whole vocabulary: take cluster i's rows
            w, b = w[self.bounds[i] : self.bounds[i + 1]], b[self.bounds[i] : self.bounds[i + 1]]
        if i == 0 and len(self.bounds) > 2:
            w, b = torch.cat([w, self.cluster_weight]), torch.cat([b, self.cluster_bias])
        if len(self.out_projs):
            h = F.linear(h, self.out_projs[i].t())
        return F.linear(h, w, b)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., V) log-probs
        head = F.log_softmax(self._logits(h, 0).float(), -1)
        n_tail = len(self.bounds) - 2
        if n_tail == 0:
            return head
        shortlist = self.bounds[1]
        parts = [head[..., :shortlist]]
        for i in range(1, n_tail + 1):
            # log p(token) = log p(cluster i) + log p(token | cluster i)
            tail = F.log_softmax(self._logits(h, i).float(), -1)
            parts.append(head[..., shortlist + i - 1 : shortlist + i] + tail)
        return torch.cat(parts, -1)


class TransformerXL(LanguageModel):
    family = "transformer-xl"
    config_class = TransformerXLConfig
    persistent = ("mem", "last_hidden", "n_tokens")  # k and v are rebuilt from mem on load
    # mem rounded as appended (`model.state.precision`), the keys and values projected from it
    cache_precisions = PRECISIONS

    def __init__(self, config: TransformerXLConfig):
        super().__init__(config)
        cfg = config
        self.word_emb: nn.Embedding | AdaptiveEmbedding = (
            AdaptiveEmbedding(cfg) if cfg.adaptive else nn.Embedding(cfg.vocab_size, cfg.d_model)
        )
        self.emb_scale = cfg.d_model**0.5
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        if not cfg.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.final_norm = (
            nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon) if cfg.final_norm else nn.Identity()
        )
        # the output layer: `out` (native) or `crit` (adaptive, named as in the original)
        if cfg.adaptive:
            self.crit = ProjectedAdaptiveLogSoftmax(cfg)
        else:
            self.out = nn.Linear(cfg.d_model, cfg.vocab_size)
            if cfg.tie_weights:
                self.out.weight = self.word_emb.weight  # type: ignore[assignment]
        self._tables: PositionTables | None = None  # inference only (`_positions`)
        self._masks: dict[tuple, tuple[torch.Tensor, bool]] = {}  # by shape (`_mask`)
        self.apply(init_weights)
        if cfg.adaptive:
            self._init_adaptive()

    def _init_adaptive(self) -> None:
        """Initialise the adaptive projections, then tie the softmax to the embedding."""
        cfg, emb, crit = self.config, self.word_emb, self.crit
        assert isinstance(emb, AdaptiveEmbedding)
        for p in [*emb.emb_projs, *crit.out_projs]:
            nn.init.normal_(p, 0.0, 0.01)
        if cfg.tie_weights:
            for out_l, emb_l in zip(crit.out_layers, emb.emb_layers, strict=True):
                out_l.weight = emb_l.weight
        for i, tie in enumerate(cfg.tie_projs):
            if tie and len(crit.out_projs):
                crit.out_projs[i] = emb.emb_projs[0 if cfg.div_val == 1 else i]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (..., d_model) -> logits (..., V)."""
        h = self.final_norm(h)
        return self.crit(h) if self.config.adaptive else self.out(h)

    def config_dict(self) -> dict:
        d = super().config_dict()
        return {k: v for k, v in d.items() if k not in PRETRAINED_DEFAULTS or v != PRETRAINED_DEFAULTS[k]}

    def blocks(self) -> list[DecoderLayer]:
        """The decoder layers, typed (an nn.ModuleList only promises Modules)."""
        return list(self.layers)  # type: ignore[arg-type]

    def train(self, mode: bool = True) -> TransformerXL:
        self._tables = None  # weights may change: the projected position tables are stale
        super().train(mode)
        return self

    # -- state: memory rows, their cached keys and values, the last hidden state ----------
    def time_axes(self) -> dict[str, TimeAxis]:
        cfg = self.config
        kv = TimeAxis(cfg.n_layer, cfg.n_head * cfg.d_head, cfg.mem_len)
        return {"mem": TimeAxis(cfg.n_layer, cfg.d_model, cfg.mem_len), "k": kv, "v": kv}

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"last_hidden": (self.config.d_model,)}

    def batch_layouts(self) -> dict[str, bool]:
        return {"mem": False, "k": True, "v": True}  # as `advance` grows them for a decode step

    @torch.no_grad()
    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        mem = tensors["mem"]
        ks, vs = [], []
        with self.autocast():
            for i, layer in enumerate(self.blocks()):
                k, v = layer.dec_attn.project_kv(mem[:, i])
                ks.append(k)
                vs.append(v)
        dtype = mem.dtype
        hd = self.config.n_head * self.config.d_head
        B, L, M, _ = mem.shape
        k = torch.stack(ks, 1).to(dtype) if ks else mem.new_zeros(B, L, M, hd)
        v = torch.stack(vs, 1).to(dtype) if vs else mem.new_zeros(B, L, M, hd)
        return self._state({**tensors, "k": k, "v": v})

    # -- forward --------------------------------------------------------------------------
    def _mask(self, T: int, M: int, valid: torch.Tensor) -> torch.Tensor | None:
        """(B, T, M+T) True where query i may not attend to key j; None where every query may
        attend to every key (a decode step over full memories). The part the shapes decide is
        cached; the left padding of short memories is per stream."""
        dev = valid.device
        if torch.compiler.is_compiling():  # one graph: no cache, no host reads
            return self._blocked(T, M, dev)[None] | self._padding(T, M, valid)[:, None]
        cached = self._masks.get((T, M, dev))
        if cached is None:
            blocked = self._blocked(T, M, dev)
            if len(self._masks) >= 64:
                self._masks.clear()
            cached = self._masks[(T, M, dev)] = (blocked, bool(blocked.any()))
        blocked, any_blocked = cached
        if not bool((valid < M).any()):  # no stream's memory is padded
            return blocked[None] if any_blocked else None
        return blocked[None] | self._padding(T, M, valid)[:, None]

    @staticmethod
    def _padding(T: int, M: int, valid: torch.Tensor) -> torch.Tensor:
        """(B, M+T) True at the left padding of each stream's shorter memory."""
        return torch.arange(M + T, device=valid.device) < (M - valid)[:, None]

    def _blocked(self, T: int, M: int, dev: torch.device) -> torch.Tensor:
        """(T, M+T) True where query i may not attend to key j, whatever the streams hold."""
        cfg = self.config
        dist = M + torch.arange(T, device=dev)[:, None] - torch.arange(M + T, device=dev)
        blocked = dist < 0
        if cfg.attention == "window":
            blocked = blocked | (dist > cfg.mem_len)
        elif cfg.same_length:
            blocked = blocked | (dist >= cfg.mem_len)
        return blocked

    def _distances(self, K: int, device: torch.device) -> torch.Tensor:
        """The relative distances K-1 .. 0 of a query to its keys, as R indexes them:
        distances beyond those any query may attend share the last embedding."""
        cfg = self.config
        dist = torch.arange(K - 1, -1, -1, device=device)
        if cfg.clamp_len > 0:
            dist = dist.clamp(max=cfg.clamp_len)
        if cfg.attention == "window":
            dist = dist.clamp(max=cfg.mem_len + 1)  # farther keys are masked anyway
        elif cfg.same_length:
            dist = dist.clamp(max=cfg.mem_len)
        return dist

    def _positions(self, K: int, device: torch.device) -> PositionTables:
        """Inference tables over at least K distances, built once and cached for the reach of
        the usual chunk (mem_len + tgt_len + 1 distances); a longer chunk's are its own."""
        cfg = self.config
        P = cfg.mem_len + cfg.tgt_len + 1
        tables = self._tables
        if K <= P and tables is not None and tables.rk[0].device == device:
            return tables
        r = sinusoid(self._distances(max(K, P), device), cfg.d_model).to(self.param_dtype)  # (P, d)
        tables = PositionTables([lay.dec_attn.r_net(r).t().contiguous().detach() for lay in self.blocks()])
        if K <= P:
            self._tables = tables
        return tables

    def _rel_keys(self, layer: int, K: int, device: torch.device) -> torch.Tensor:
        """Training: W_{k,R} R for distances K-1 .. 0 (K, H, dh), with gradients."""
        cfg = self.config
        r = sinusoid(self._distances(K, device), cfg.d_model)
        return self.blocks()[layer].dec_attn.r_net(r).view(K, cfg.n_head, cfg.d_head)

    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        cfg = self.config
        B, T = tokens.shape
        if not self.training and "k" not in state.tensors:  # eval needs the key/value cache
            state = self.rebuild_state({name: state[name] for name in self.persistent})
        mem = state["mem"]  # (B, L, M, d)
        M = mem.shape[2]
        keep = min(cfg.mem_len, M + T)  # memory rows carried to the next call
        in_place = how.in_place
        grown = {"mem": state.window("mem").grow(T, in_place)}
        if not self.training:  # training projects the memory afresh (with gradients): no cache
            # decode steps scan each stream's keys and values along time (`attend_one`): their
            # arenas are time-major, as a stacked batch's are from the start (`batch_layouts`)
            layouts = self.batch_layouts()
            grown.update(
                {name: state.window(name).grow(T, in_place, T == 1 and layouts[name]) for name in ("k", "v")}
            )
        mask = self._mask(T, M, state.n_tokens.clamp(max=cfg.mem_len))

        with self.autocast():
            h = self.drop(self.word_emb(tokens) * self.emb_scale)  # (B, T, d)
            h = self._layers(h, mem, grown, mask)
            logits = self.head(how.logit_rows(h))  # (B, T or 1, V)

        tensors, arenas = unzip({name: g.result(keep) for name, g in grown.items()})
        tensors["last_hidden"] = h[:, -1].detach().to(mem.dtype)
        tensors["n_tokens"] = state.n_tokens + T
        return logits.float(), self._state(tensors, arenas)

    def _layers(
        self, h: torch.Tensor, mem: torch.Tensor, grown: dict[str, Growth], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The decoder layers over the chunk's embeddings h (B, T, d), appending each layer's
        input to its memory (and its keys and values to the cache, at inference)."""
        cfg = self.config
        T, K, dev = h.shape[1], mem.shape[2] + h.shape[1], h.device
        tables = None if self.training else self._positions(K, dev)
        rounded = grown["mem"].precision != "float32"
        for i, layer in enumerate(self.blocks()):
            kept = grown["mem"].append(i, h.detach())  # SG(h): the memory carries no gradient
            stored = kept[:, -T:] if rounded else None  # h as the memory keeps it
            attn = layer.dec_attn
            u = attn.r_w_bias if cfg.untie_r else self.r_w_bias
            vb = attn.r_r_bias if cfg.untie_r else self.r_r_bias
            if tables is None:  # training: no key/value cache, the memory projected afresh
                h = attn(h, mem[:, i], self._rel_keys(i, K, dev), mask, u, vb, None)
            else:
                kv = kv_appender(grown["k"], grown["v"], i)
                if T == 1:  # a decode step
                    h = attn.step(h, tables.rk[i][:, -K:], mask, u, vb, kv, stored)
                else:
                    h = attn(h, mem[:, i], tables.keys(i, K, cfg.n_head), mask, u, vb, kv, stored)
            h = layer.pos_ff(h)
        return self.drop(h)

    def next_logits(self, state: State) -> torch.Tensor:
        with self.autocast():
            return self.head(state["last_hidden"]).float()
