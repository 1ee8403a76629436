"""Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): Gated DeltaNet layers (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025) with a
gated attention layer among every few (`model/hybrid.py`).

Read top to bottom: config, the delta rule (a step, then chunks), the mixer, the family.

The Gated DeltaNet layer, per value head (b: batch, T: time, Hk key heads of dk channels,
Hv value heads of dv, each key head serving Hv/Hk consecutive value heads):
  q, k, v = silu(conv1d(in_proj_qkv(u)))      a causal depthwise conv over q, k and v at once
  q, k <- q / |q| * dk^-1/2, k / |k|          each head L2-normalised (eps 1e-6 under the root)
  beta_t = sigmoid(b_t),  g_t = -exp(A_log) softplus(a_t + dt_bias)   (b, a) = in_proj_ba(u)
  S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T     (dk, dv)       (Eq. 10)
  o_t = S_t^T q_t
  out = out_proj(RMSNorm(o) * silu(z)),  z = in_proj_z(u)             the norm per head, before the gate
Written as the delta rule: S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T.

Execution. A decode step (T = 1) is Eq. 10 itself (`delta_step`). A prefill runs the chunkwise
(WY) form (`delta_chunks`; Sec. 3.3 of the paper, after DeltaNet's, Yang et al. 2024): inside a
chunk of C tokens the C rank-one updates collapse into one triangular solve (the UT transform
of the WY representation), so the chunk is a few matmuls; between chunks the state is carried
as in the recurrence. Any chunking gives the same results, up to rounding
(tests/model/test_gdn_hybrid.py).

Conversion: `model/hf_hybrid.py` reads Qwen3.5 (its separate q/k/v, z, b and a projections,
which are this layer's) and Qwen3-Next (one qkvz and one ba projection grouped by key head,
reordered here on reading); their zero-centred norms (weight 1 + w) are stored as plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .hybrid import Hybrid, HybridConfig
from .norms import RMSNorm, rms_norm
from .recurrent_mixer import SSMMixer, causal_conv, init_dt_bias


@dataclass
class GDNHybridConfig(HybridConfig):
    n_k_heads: int = 2  # Hk: the Gated DeltaNet's query / key heads
    n_v_heads: int = 4  # Hv: its value heads (a multiple of Hk)
    k_head_dim: int = 16  # dk
    v_head_dim: int = 16  # dv
    chunk_size: int = 64  # the chunkwise form's block (results do not depend on it)
    attn_gate: bool = True
    qk_norm: bool = True
    rope_dim: int = 4  # a quarter of the head, Qwen3-Next's partial rotary factor

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.n_k_heads, self.k_head_dim, self.v_head_dim, self.chunk_size) < 1:
            raise ValueError("n_k_heads, k_head_dim, v_head_dim and chunk_size must be >= 1")
        if self.n_v_heads < 1 or self.n_v_heads % self.n_k_heads:
            raise ValueError("n_v_heads must be a multiple of n_k_heads")


# -- the delta rule -------------------------------------------------------------------------
def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the last dim (FLA's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_step(
    q: torch.Tensor,  # (b, H, dk), scaled
    k: torch.Tensor,  # (b, H, dk)
    v: torch.Tensor,  # (b, H, dv)
    g: torch.Tensor,  # (b, H) log decay
    beta: torch.Tensor,  # (b, H)
    S: torch.Tensor,  # (b, H, dk, dv)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Eq. 10 -> o (b, H, dv) and S'."""
    S = S * torch.exp(g)[..., None, None]
    delta = (v - (k[..., None] * S).sum(-2)) * beta[..., None]  # (b, H, dv)
    S = torch.addcmul(S, k[..., None], delta[..., None, :])
    return (q[..., None] * S).sum(-2), S


def delta_chunks(
    q: torch.Tensor,  # (b, H, T, dk), scaled
    k: torch.Tensor,  # (b, H, T, dk)
    v: torch.Tensor,  # (b, H, T, dv)
    g: torch.Tensor,  # (b, H, T) log decay
    beta: torch.Tensor,  # (b, H, T)
    S: torch.Tensor,  # (b, H, dk, dv) the state before the first token
    C: int,  # chunk length
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every o_t (b, H, T, dv) and the last S, chunk by chunk (the WY form). Within a chunk,
    with G_t = g_1 + .. + g_t and L_ij = exp(G_i - G_j) for j <= i, the updates unroll to
        U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k exp(G)),  A = tril_-1(beta k k^T o L)
        V' = U - W S,  o = (q exp(G)) S + tril(q k^T o L) V',  S' = exp(G_C) S + (k exp(G_C - G))^T V'
    so the chunk is one triangular solve and a few matmuls."""
    b, H, T, _ = q.shape
    pad = -T % C  # steps after the end with beta = 0 and g = 0 change nothing
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, C)) for t in (q, k, v))  # (b, H, c, C, d)
    g, beta = (F.pad(t, (0, pad)).unflatten(2, (-1, C)) for t in (g, beta))  # (b, H, c, C)
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    L = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, -torch.inf))  # (b, H, c, C, C)
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * L).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    UW = torch.linalg.solve_triangular(
        eye + A,
        torch.cat([v * beta[..., None], kb * torch.exp(G)[..., None]], -1),
        upper=False,
        unitriangular=True,
    )
    U, W = UW.split([v.shape[-1], k.shape[-1]], -1)
    inner = (q @ k.transpose(-1, -2)) * L  # (b, H, c, C, C), lower triangle with the diagonal
    q_in = q * torch.exp(G)[..., None]
    k_out = k * torch.exp(G[..., -1:] - G)[..., None]
    decay = torch.exp(G[..., -1])[..., None, None]  # (b, H, c, 1, 1)
    S = S.to(q.dtype)
    out = []
    for i in range(q.shape[2]):
        V = U[:, :, i] - W[:, :, i] @ S  # (b, H, C, dv)
        out.append(q_in[:, :, i] @ S + inner[:, :, i] @ V)
        S = S * decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ V
    return torch.cat(out, 2)[:, :, :T], S


# -- the mixer ------------------------------------------------------------------------------
class GatedDeltaNet(SSMMixer):
    def __init__(self, cfg: GDNHybridConfig):
        super().__init__()
        self.Hk, self.Hv, self.dk, self.dv = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
        self.chunk_size = cfg.chunk_size
        key, value = self.Hk * self.dk, self.Hv * self.dv
        conv_dim = 2 * key + value  # q, k and v go through the conv
        self.in_proj_qkv = nn.Linear(cfg.d_model, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.d_model, value, bias=False)
        self.in_proj_ba = nn.Linear(cfg.d_model, 2 * self.Hv, bias=False)  # [b; a]
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, cfg.d_conv, groups=conv_dim, padding=cfg.d_conv - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = RMSNorm(self.dv, cfg.norm_eps)  # each head's output, before the gate
        self.out_proj = nn.Linear(value, cfg.d_model, bias=False)

    @staticmethod
    def state_shapes(cfg: GDNHybridConfig) -> tuple[int, tuple[int, ...]]:
        conv_dim = 2 * cfg.n_k_heads * cfg.k_head_dim + cfg.n_v_heads * cfg.v_head_dim
        return conv_dim, (cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim)

    def reset_ssm(self) -> None:
        """A = -(1..16) spread over the heads, Mamba's Delta as the decay's step (after GPT-2's init)."""
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty(self.Hv).uniform_(1, 16)))
        init_dt_bias(self.dt_bias)
        for p in (self.A_log, self.dt_bias):
            p._no_weight_decay = True  # type: ignore[attr-defined]

    def forward(
        self,
        u: torch.Tensor,  # (b, T, d_model), normalised
        window: torch.Tensor,  # (b, K-1, conv_dim) the conv's last inputs
        S: torch.Tensor,  # (b, Hv, dk, dv)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, T, _ = u.shape
        Hk, Hv, dk, dv = self.Hk, self.Hv, self.dk, self.dv
        qkv, window = causal_conv(self.in_proj_qkv(u), window, self.conv1d)
        q, k, v = F.silu(qkv).float().split([Hk * dk, Hk * dk, Hv * dv], -1)
        q, k = (l2_normalised(t.view(n, T, Hk, dk)).repeat_interleave(Hv // Hk, 2) for t in (q, k))
        q = q * dk**-0.5
        v = v.view(n, T, Hv, dv)
        b, a = self.in_proj_ba(u).float().chunk(2, -1)  # (b, T, Hv) each
        beta = torch.sigmoid(b)
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())
        if T == 1:
            o, S = delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S.float())
            o = o[:, None]  # (b, 1, Hv, dv)
        else:
            qh, kh, vh, gh, bh = (t.transpose(1, 2) for t in (q, k, v, g, beta))  # (b, Hv, T, ...)
            o, S = delta_chunks(qh, kh, vh, gh, bh, S.float(), self.chunk_size)
            o = o.transpose(1, 2)
        z = self.in_proj_z(u).float().view(n, T, Hv, dv)
        y = (rms_norm(o, self.norm) * F.silu(z)).reshape(n, T, Hv * dv)
        return self.out_proj(y.to(u.dtype)), window, S


class GDNHybrid(Hybrid):
    family = "gdn-hybrid"
    config_class = GDNHybridConfig
    mixer_class = GatedDeltaNet
