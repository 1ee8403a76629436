"""Mamba-2's SSD layer (Dao and Gu, 2024): the recurrent mixer that the `mamba2` family
(`model/mamba2.py`, every layer one) and the `mamba2-hybrid` family (`model/mamba2_hybrid.py`,
with attention among them) share. A layer, not a family: it knows neither model, and
neither family's config: each config gives the layer's shape as an `SSDConfig` (`ssd()`).

Read top to bottom: the layer's config, SSD's chunked algorithm, the gated norm, the mixer.

Notation follows the paper (b: batch, T: time, H heads of P channels, D = H*P = expand *
d_model, N = d_state, G groups of heads sharing B and C):
  z, xBC, dt = in_proj(u)                 every projection at once, in parallel (Sec. 7.1)
  x, B, C = silu(conv1d(xBC))             x (b, T, H, P); B, C (b, T, G, N)
  Delta_t = softplus(dt + dt_bias)        (b, T, H), within dt_limit
  a_t = exp(Delta_t A), A = -exp(A_log)   one scalar per head (Sec. 3.1.3)
  h_t = a_t h_{t-1} + (Delta_t x_t) B_t^T (P, N) per head                          (Eq. 1)
  y_t = h_t C_t + D_skip x_t
  out = out_proj(RMSNorm_G(y * silu(z)))  the norm over each group's channels (Sec. 7.1)

Execution. Prefill is SSD's chunked algorithm (Sec. 6, Listing 1): inside chunks of
`chunk_size` tokens the quadratic (attention-like) form, between chunks the recurrence over
the chunks' states, from the stream's state h at the chunk's start. A decode step (T = 1)
is the recurrence (Eq. 1). Any chunking gives the same result, up to rounding.

A layer's state: the conv window (b, d_conv-1, D + 2*G*N) and h (b, H, P, N). Its parameter
names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj) are the checkpoints' and HF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .norms import RMSNorm
from .recurrent_mixer import SSMMixer, causal_conv, init_dt_bias


@dataclass
class SSDConfig:
    """One SSD layer's shape, as a family's config gives it."""

    d_model: int
    d_state: int = 64  # N
    d_conv: int = 4  # the causal convolution's width, itself included
    expand: int = 2  # D = expand * d_model
    head_dim: int = 32  # P; H = D / P heads
    n_groups: int = 1  # G: heads in a group share B and C
    chunk_size: int = 64  # SSD's block length (results do not depend on it)
    dt_limit: tuple[float, float | None] = (0.0, None)  # Delta is clamped into it (None: no upper bound)
    bias: bool = False  # in_proj and out_proj biases
    conv_bias: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if min(self.d_model, self.d_state, self.d_conv, self.expand) < 1:
            raise ValueError("d_model, d_state, d_conv and expand must be >= 1")
        lo, hi = self.dt_limit  # JSON gives a list; strict JSON has no infinity, so no bound is None
        lo, hi = float(lo), None if hi is None or math.isinf(hi) else float(hi)
        self.dt_limit = (lo, hi)
        if self.head_dim < 1 or self.d_inner % self.head_dim:
            raise ValueError("expand * d_model must split into heads of head_dim channels")
        if self.n_groups < 1 or self.n_heads % self.n_groups:
            raise ValueError("n_groups must divide the number of heads")
        if self.chunk_size < 1 or not 0 <= lo <= (math.inf if hi is None else hi):
            raise ValueError("chunk_size must be >= 1 and dt_limit an interval of non-negative numbers")

    @classmethod
    def of(cls, config: object, **renamed: Any) -> SSDConfig:
        """The shape a family's config gives: each field its field of the same name, but
        those that `renamed` gives (the config names them otherwise, or not at all)."""
        return cls(
            **{f.name: getattr(config, f.name) for f in fields(cls) if f.name not in renamed}, **renamed
        )

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim


class HasSSD(Protocol):
    """A family's config, which gives its SSD layers' shape."""

    def ssd(self) -> SSDConfig: ...


# -- SSD: the chunked algorithm (Sec. 6, Listing 1) ----------------------------------------
def segsum(a: torch.Tensor) -> torch.Tensor:
    """(..., Q) -> (..., Q, Q): [i, j] = a_{j+1} + ... + a_i for j <= i (log of the decay from
    j to i), -inf above the diagonal. Sums of differences, not differences of cumsums."""
    Q = a.shape[-1]
    x = a[..., None].expand(*a.shape, Q)  # [.., i, j] = a_i
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), -1)
    x = x.masked_fill(~strict, 0).cumsum(-2)
    return x.masked_fill(~torch.tril(torch.ones_like(strict)), -math.inf)


def ssd(
    x: torch.Tensor,  # (b, T, H, P) Delta_t x_t
    a: torch.Tensor,  # (b, T, H) Delta_t A, the log of a_t
    B: torch.Tensor,  # (b, T, G, N)
    C: torch.Tensor,  # (b, T, G, N)
    h0: torch.Tensor,  # (b, H, P, N) the state before x
    Q: int,  # chunk length
) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = h_t C_t for every t (b, T, H, P) and the last h (b, H, P, N), h_t by Eq. 1.
    Heads are split into groups g of r heads (those that share B and C) and laid out
    before the chunks c and positions l, so every product is a batched matmul."""
    n, T, H, P = x.shape
    G, N = B.shape[2:]
    pad = -T % Q  # zero steps after the end (a = 0 decays nothing, x = B = 0 adds nothing)
    x, a, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, a, B, C))
    c, r = (T + pad) // Q, H // G
    x = x.view(n, c, Q, G, r, P).permute(0, 3, 4, 1, 2, 5)  # (b, g, r, c, l, p)
    B, C = (t.view(n, c, Q, G, 1, N).permute(0, 3, 4, 1, 2, 5) for t in (B, C))  # (b, g, 1, c, l, n)
    a = a.view(n, c, Q, G, r).permute(0, 3, 4, 1, 2)  # (b, g, r, c, l)
    a_cum = a.cumsum(-1)
    # 1. inside each chunk, the quadratic form: y = (L o C B^T) x
    y = (torch.exp(segsum(a)) * (C @ B.transpose(-1, -2))) @ x  # (b, g, r, c, l, p)
    # 2. each chunk's own contribution to the state at its end, B^T (decay o x) (n, p)
    states = B.transpose(-1, -2) @ (torch.exp(a_cum[..., -1:] - a_cum)[..., None] * x)  # (b, g, r, c, n, p)
    # 3. the recurrence over chunks, from h0: the state at every chunk's start, and the last
    h0 = h0.view(n, G, r, 1, P, N).transpose(-1, -2).to(states.dtype)
    states = torch.cat([h0, states], 3)  # (b, g, r, c+1, n, p)
    decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # (b, g, r, c+1, c+1)
    states = (decay @ states.flatten(-2)).view(states.shape)
    # 4. each chunk's start state, decayed to every position and read out
    y = y + (C @ states[:, :, :, :-1]) * torch.exp(a_cum)[..., None]
    y = y.permute(0, 3, 4, 1, 2, 5).reshape(n, c * Q, H, P)[:, :T]
    return y, states[:, :, :, -1].transpose(-1, -2).reshape(n, H, P, N)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(y * silu(z)) over each of G groups of channels (norm after the gate)."""

    def __init__(self, d: int, groups: int, eps: float):
        super().__init__(d, eps)
        self.groups = groups

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = (y * F.silu(z)).unflatten(-1, (self.groups, -1))  # (b, T, G, D/G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps_tensor)
        return g.flatten(-2) * self.weight


# -- the mixer ------------------------------------------------------------------------------
class SSDMixer(SSMMixer):
    """Built, as a family's model builds its mixers, from the family's config."""

    def __init__(self, config: HasSSD):
        super().__init__()
        cfg = config.ssd()
        D, N, G, H = cfg.d_inner, cfg.d_state, cfg.n_groups, cfg.n_heads
        self.d_inner, self.N, self.G, self.H, self.P = D, N, G, H, cfg.head_dim
        self.chunk_size, self.dt_limit = cfg.chunk_size, cfg.dt_limit
        conv_dim = D + 2 * G * N  # x, B and C go through the conv
        self.in_proj = nn.Linear(cfg.d_model, D + conv_dim + H, bias=cfg.bias)  # z, xBC, dt
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, cfg.d_conv, groups=conv_dim, padding=cfg.d_conv - 1, bias=cfg.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))  # the skip D_skip, per head
        self.norm = GatedRMSNorm(D, G, cfg.norm_eps)
        self.out_proj = nn.Linear(D, cfg.d_model, bias=cfg.bias)

    @staticmethod
    def state_shapes(config: HasSSD) -> tuple[int, tuple[int, ...]]:
        cfg = config.ssd()
        return cfg.d_inner + 2 * cfg.n_groups * cfg.d_state, (cfg.n_heads, cfg.head_dim, cfg.d_state)

    def reset_ssm(self) -> None:
        """A = -(1..16) spread over the heads, D_skip = 1, the paper's Delta (after GPT-2's init)."""
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty(self.H).uniform_(1, 16)))
            self.D.fill_(1.0)
        init_dt_bias(self.dt_bias)
        for p in (self.A_log, self.D, self.dt_bias):
            p._no_weight_decay = True  # type: ignore[attr-defined]

    def forward(
        self,
        u: torch.Tensor,  # (b, T, d_model), normalised
        window: torch.Tensor,  # (b, K-1, conv_dim) the conv's last inputs
        h: torch.Tensor,  # (b, H, P, N) h_{t-1}
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, T, _ = u.shape
        D, N, G, H, P = self.d_inner, self.N, self.G, self.H, self.P
        z, xBC, dt = self.in_proj(u).split([D, D + 2 * G * N, H], -1)
        xBC, window = causal_conv(xBC, window, self.conv1d)
        x, B, C = F.silu(xBC).float().split([D, G * N, G * N], -1)
        x, B, C = x.view(n, T, H, P), B.view(n, T, G, N), C.view(n, T, G, N)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # Delta (b, T, H)
        a = dt * -torch.exp(self.A_log.float())  # log a_t (b, T, H)
        xdt = x * dt[..., None]  # Delta_t x_t (b, T, H, P)
        h = h.float()
        if T == 1:  # Eq. 1, one step; each head reads its group's B and C
            Bh, Ch = (t[:, 0].repeat_interleave(H // G, 1) for t in (B, C))  # (b, H, N)
            h = torch.addcmul(h * torch.exp(a[:, 0, :, None, None]), xdt[:, 0, :, :, None], Bh[:, :, None, :])
            y = (h @ Ch[..., None]).view(n, 1, H, P)
        else:
            y, h = ssd(xdt, a, B, C, h, self.chunk_size)
        y = torch.addcmul(y, x, self.D.float()[:, None]).reshape(n, T, D)  # (b, T, D)
        y = self.norm(y, z.float())
        return self.out_proj(y.to(u.dtype)), window, h
