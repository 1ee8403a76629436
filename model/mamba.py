"""Mamba (Gu and Dao, 2023): a selective state-space model, and what Mamba-2 shares with it.

Read top to bottom: config, the selective scan, the mixer, the block, the model. The
causal convolution and the mixer's interface are every recurrent mixer's
(`model/recurrent_mixer.py`). `model/mamba2.py` swaps the mixer for Mamba-2's SSD layer and keeps the
rest (block, model, state).

Notation follows the paper (b: batch, T: time, D = expand * d_model channels, N = d_state):
  x_t, z_t = in_proj(u_t)                        the SSM input and its gate (B, T, D) each
  x_t <- silu(conv1d(x)_t)                       causal depthwise conv of width d_conv
  Delta_t = softplus(W_dt s_Delta(x_t) + b_dt)   s_Delta: a rank-R projection   (Alg. 2)
  B_t, C_t = s_B(x_t), s_C(x_t)                  (N,) each, input-dependent      (Alg. 2)
  A = -exp(A_log)                                 (D, N), input-independent
  Abar_t = exp(Delta_t A), Bbar_t = Delta_t B_t   discretisation, ZOH for A        (Eq. 4)
  h_t = Abar_t * h_{t-1} + Bbar_t x_t             (D, N) per stream               (Eq. 2a)
  y_t = C_t h_t + D_skip * x_t                                                     (Eq. 2b)
  out_t = out_proj(y_t * silu(z_t))
Each block is pre-norm with a residual (RMSNorm), the model ends with RMSNorm and a head
(tied to the embedding or not). Parameter names are HF `MambaForCausalLM`'s without its
"backbone." prefix, so a checkpoint converts by a rename (`model/hf_ssm.py`).

Execution. Prefill runs the recurrence (2a) as a parallel scan (`linear_scan`): a prompt
arrives in chunks of `segment_len` tokens, the state carried between them, and each chunk's
h_t are a work-efficient (Blelloch) scan in log2(T) whole-tensor levels; no Python loop over
tokens. Training differentiates it with a custom backward, itself a scan backwards in time,
so autograd keeps two (b, T, D, N) tensors per layer rather than every level of the scan. A
decode step (T = 1) is the recurrence itself. Any chunking gives the same result, up to
rounding.

State (batch-first, every tensor persistent, none on a time axis: its size never grows):
  conv        [b, L, d_conv-1, conv_dim]  each layer's last d_conv-1 conv inputs (zeros at first)
  ssm         [b, L, D, N]                each layer's h_t (Mamba-2: [b, L, H, P, N])
  last_hidden [b, d_model]                the last token's output, before norm_f (next_logits)
  n_tokens    [b]
Every tensor changes at every token, so a delta is the whole state (`model.state.encode`
then writes a snapshot); it stays the same size however long the session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .family import Execution, LanguageModel, TimeAxis, init_weights
from .norms import RMSNorm, rms_norm
from .recurrent_mixer import SSMMixer, causal_conv, init_dt_bias
from .state import State


@dataclass
class SSMConfig:
    """What both Mamba generations configure alike."""

    vocab_size: int = 258
    n_layer: int = 4
    d_model: int = 128
    d_state: int = 16  # N
    d_conv: int = 4  # the causal convolution's width, itself included
    expand: int = 2  # D = expand * d_model
    conv_bias: bool = True
    bias: bool = False  # in_proj and out_proj biases
    tie_weights: bool = True  # the head is the token embedding
    norm_eps: float = 1e-5
    tgt_len: int = 128  # training segment; also the serving chunk (results do not depend on it)

    def __post_init__(self) -> None:
        if min(self.n_layer, self.d_model, self.d_state, self.d_conv, self.expand, self.tgt_len) < 1:
            raise ValueError("n_layer, d_model, d_state, d_conv, expand and tgt_len must be >= 1")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model


@dataclass
class MambaConfig(SSMConfig):
    dt_rank: int = 0  # R, the rank of Delta's projection; 0: ceil(d_model / 16), the paper's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dt_rank < 0:
            raise ValueError("dt_rank must be >= 0")

    @property
    def rank(self) -> int:
        return self.dt_rank or math.ceil(self.d_model / 16)


# -- the selective scan (Eq. 2a) ----------------------------------------------------------
def _scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every h_t of h_t = a_t * h_{t-1} + b_t along dim 1, from h_{-1} = 0: a work-efficient
    parallel scan (Blelloch's). Each pair of steps composes into one step,
    h_{2i+1} = (a_{2i+1} a_{2i}) h_{2i-1} + (a_{2i+1} b_{2i} + b_{2i+1}), whose scan (half as
    long) gives every odd h; each even h is then one step from the odd h before it. log2(T)
    levels of whole-tensor operations, about twice the work of the loop over t."""
    T = a.shape[1]
    if T == 1:
        return b
    m = T - T % 2
    a2, b2 = a[:, :m].unflatten(1, (-1, 2)), b[:, :m].unflatten(1, (-1, 2))  # (b, T/2, 2, ...)
    odd = _scan(a2[:, :, 1] * a2[:, :, 0], torch.addcmul(b2[:, :, 1], a2[:, :, 1], b2[:, :, 0]))
    before = torch.cat([torch.zeros_like(odd[:, :1]), odd[:, :-1]], 1)  # h_{2i-1}
    h = torch.stack([torch.addcmul(b2[:, :, 0], a2[:, :, 0], before), odd], 2).flatten(1, 2)
    if m < T:  # an odd length: the last step on its own
        h = torch.cat([h, torch.addcmul(b[:, -1:], a[:, -1:], h[:, -1:])], 1)
    return h


def _scan_from(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """`_scan` from h_{-1} = h0 (b, ...), folded into the first step: (b, T, ...)."""
    first = torch.addcmul(b[:, :1], a[:, :1], h0[:, None])
    return first if a.shape[1] == 1 else _scan(a, torch.cat([first, b[:, 1:]], 1))


class _LinearScan(torch.autograd.Function):
    """`_scan_from` with its gradient, a scan backwards in time:
    g_t = dL/dh_t + a_{t+1} g_{t+1};  dL/db_t = g_t,  dL/da_t = g_t h_{t-1},  dL/dh0 = a_0 g_0."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        h = _scan_from(a, b, h0)
        ctx.save_for_backward(a, h, h0)
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, h, h0 = ctx.saved_tensors
        a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], 1)
        g = _scan(a_next.flip(1), grad_h.flip(1)).flip(1)
        h_prev = torch.cat([h0[:, None], h[:, :-1]], 1)
        return g * h_prev, g, a[:, 0] * g[:, 0]


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """Every h_t of h_t = a_t * h_{t-1} + b_t, h_{-1} = h0, along dim 1: a, b (b, T, ...), h0
    (b, ...) -> (b, T, ...). Differentiable (a custom backward) when autograd asks."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or h0.requires_grad):
        out: torch.Tensor = _LinearScan.apply(a, b, h0)
        return out
    return _scan_from(a, b, h0)


# -- the mixer: Algorithm 2 (S6) inside the Mamba block -----------------------------------
class MambaMixer(SSMMixer):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        D, N, R = cfg.d_inner, cfg.d_state, cfg.rank
        self.d_inner, self.N, self.R = D, N, R
        self.in_proj = nn.Linear(cfg.d_model, 2 * D, bias=cfg.bias)  # x and the gate z
        self.conv1d = nn.Conv1d(D, D, cfg.d_conv, groups=D, padding=cfg.d_conv - 1, bias=cfg.conv_bias)
        self.x_proj = nn.Linear(D, R + 2 * N, bias=False)  # s_Delta, s_B, s_C
        self.dt_proj = nn.Linear(R, D, bias=True)  # W_dt, b_dt
        self.A_log = nn.Parameter(torch.zeros(D, N))
        self.D = nn.Parameter(torch.ones(D))  # the skip D_skip
        self.out_proj = nn.Linear(D, cfg.d_model, bias=cfg.bias)

    @staticmethod
    def state_shapes(cfg: MambaConfig) -> tuple[int, tuple[int, ...]]:
        return cfg.d_inner, (cfg.d_inner, cfg.d_state)

    def reset_ssm(self) -> None:
        """S4D-real A = -(1..N) per channel, D_skip = 1, the paper's Delta (after GPT-2's init)."""
        with torch.no_grad():
            self.A_log.copy_(
                torch.log(torch.arange(1, self.N + 1, dtype=torch.float32)).expand(self.d_inner, -1)
            )
            self.D.fill_(1.0)
            nn.init.uniform_(self.dt_proj.weight, -(self.R**-0.5), self.R**-0.5)
        init_dt_bias(self.dt_proj.bias)
        for p in (self.A_log, self.D):
            p._no_weight_decay = True  # type: ignore[attr-defined]

    def forward(
        self,
        u: torch.Tensor,  # (b, T, d_model), normalised
        window: torch.Tensor,  # (b, K-1, D) the conv's last inputs
        h: torch.Tensor,  # (b, D, N) h_{t-1}
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, z = self.in_proj(u).chunk(2, -1)  # (b, T, D) each
        x, window = causal_conv(x, window, self.conv1d)
        x = F.silu(x).float()
        dt, B, C = self.x_proj(x).float().split([self.R, self.N, self.N], -1)  # (b, T, R), (b, T, N) x2
        dt = F.softplus(
            F.linear(dt, self.dt_proj.weight.float(), self.dt_proj.bias.float())
        )  # Delta (b, T, D)
        A = -torch.exp(self.A_log.float())  # (D, N)
        a = torch.exp(dt[..., None] * A)  # Abar (b, T, D, N)          Eq. 4
        bx = (dt * x)[..., None] * B[:, :, None]  # Bbar_t x_t (b, T, D, N)
        hs = linear_scan(a, bx, h.float())  # every h_t                  Eq. 2a
        y = torch.einsum("btdn,btn->btd", hs, C)  # C_t h_t              Eq. 2b
        y = torch.addcmul(y, x, self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(u.dtype)), window, hs[:, -1]


# -- the block and the model --------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual around a mixer: u + mixer(RMSNorm(u))."""

    def __init__(self, cfg: SSMConfig, mixer: SSMMixer):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer

    def forward(
        self, u: torch.Tensor, window: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, window, h = self.mixer(rms_norm(u, self.norm), window, h)
        return u + out, window, h


class Mamba(LanguageModel):
    family = "mamba"
    config_class: ClassVar[type] = MambaConfig
    mixer_class: ClassVar[type[SSMMixer]] = MambaMixer
    persistent = ("conv", "ssm", "last_hidden", "n_tokens")  # all of it

    def __init__(self, config: SSMConfig):
        super().__init__(config)
        cfg = config
        mixers = [self.mixer_class(cfg) for _ in range(cfg.n_layer)]
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, mixer) for mixer in mixers)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_weights)
        for mixer in mixers:
            mixer.reset_ssm()
            # the residual branches' outputs, scaled for depth (GPT-2's, as mamba_ssm does)
            nn.init.normal_(mixer.out_proj.weight, 0.0, 0.02 / math.sqrt(cfg.n_layer))
        if cfg.tie_weights:
            self.lm_head.weight = self.embeddings.weight

    # -- state: per layer the conv window and h; the last output ----------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        return {}  # nothing grows with the history

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        channels, ssm = self.mixer_class.state_shapes(cfg)
        return {
            "conv": (cfg.n_layer, cfg.d_conv - 1, channels),
            "ssm": (cfg.n_layer, *ssm),
            "last_hidden": (cfg.d_model,),
        }

    @property
    def context_window(self) -> int | None:
        """None: no token is attended over. The causal convolution's reach (`d_conv`, a few
        tokens) is no window a client could size its text by: everything reaches the model
        through the SSM state, and a stream has no length limit."""
        return None

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        return self._state(dict(tensors))  # every tensor is persistent: nothing to recompute

    # -- forward ----------------------------------------------------------------------------
    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        # no state tensor grows (every step rewrites all of it): `how` picks only the logits' rows
        conv, ssm = state["conv"], state["ssm"]  # (b, L, K-1, C), (b, L, ...)
        windows, hs = [], []
        with self.autocast():
            u = self.embeddings(tokens)  # (b, T, d_model)
            for i, block in enumerate(self.layers):
                u, window, h = block(u, conv[:, i], ssm[:, i])
                windows.append(window.to(conv.dtype))
                hs.append(h.to(ssm.dtype))
            logits = self.lm_head(rms_norm(how.logit_rows(u), self.norm_f))  # (b, T or 1, V)
        tensors = {
            "conv": torch.stack(windows, 1),
            "ssm": torch.stack(hs, 1),
            "last_hidden": u[:, -1].to(state["last_hidden"].dtype),
            "n_tokens": state.n_tokens + tokens.shape[1],
        }
        return logits.float(), self._state(tensors)

    def next_logits(self, state: State) -> torch.Tensor:
        with self.autocast():
            return self.lm_head(rms_norm(state["last_hidden"], self.norm_f)).float()
