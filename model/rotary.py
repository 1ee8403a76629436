"""Rotary position embeddings (RoPE, Su et al., 2021) in the rotate-half form HF writes,
shared by every family that rotates queries and keys (`rlt.py`, and through
`attention.py` `llama.py` and the hybrids).

Angles are computed in float64 from int64 positions, so a position gets the same rotation
whichever chunk it arrives in, even millions of tokens into a session. A rotation may cover
only the first dimensions of each head (`rotate`: partial RoPE, Qwen3-Next's), or none
(NoPE, Granite-4.0-H's). Nothing here knows a family.
"""

from __future__ import annotations

import torch

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin (B, T, 1, hd), see `apply_rope`


def rope_angles(pos: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> Rope:
    """Absolute positions (B, T) -> cos, sin (B, T, 1, hd) in `dtype`, the sines of the first
    half negated (`apply_rope`). Angles are computed in float64, so a position gets the same
    rotation whichever chunk it arrives in, even far into a long session."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim)
    ang = pos.to(torch.float64)[..., None] * inv_freq  # (B, T, hd/2)
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([cos, cos], -1)[:, :, None].to(dtype), torch.cat([-sin, sin], -1)[:, :, None].to(dtype)


def apply_rope(x: torch.Tensor, cs: Rope, n_head: int) -> torch.Tensor:
    """Rotate each head of x (B, T, n_head*hd) by its position, rotate-half form:
    [x1; x2] -> [x1 cos - x2 sin; x2 cos + x1 sin] = x cos + [x2; x1] (signed sin)."""
    B, T, D = x.shape
    hd = D // n_head
    xh = x.view(B, T, n_head, hd)
    swapped = xh.roll(hd // 2, -1)  # [x2; x1]
    cos, sin = cs if cs[0].dtype == x.dtype else (cs[0].to(x.dtype), cs[1].to(x.dtype))
    return torch.addcmul(xh * cos, swapped, sin).view(B, T, D)


def rotate_twice(x: torch.Tensor, pair: Rope, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, n_head*hd) rotated two ways at once (`apply_rope`'s product, one swap of its
    halves for both): `pair` holds the two rotations' cos and signed sin (B, T, 2, 1, hd)
    (`pair_of`). Each result is what `apply_rope` gives with that rotation alone, to the bit
    (the same products, each element's own)."""
    B, T, D = x.shape
    hd = D // n_head
    xh = x.view(B, T, 1, n_head, hd)
    cos, sin = pair if pair[0].dtype == x.dtype else (pair[0].to(x.dtype), pair[1].to(x.dtype))
    both = torch.addcmul(xh * cos, xh.roll(hd // 2, -1), sin)  # (B, T, 2, n_head, hd)
    return both[:, :, 0].view(B, T, D), both[:, :, 1].view(B, T, D)


def pair_of(a: Rope, b: Rope) -> Rope:
    """Two rotations (B, T, 1, hd) side by side for `rotate_twice` -> (B, T, 2, 1, hd)."""
    return torch.stack([a[0], b[0]], 2), torch.stack([a[1], b[1]], 2)


def rotate(x: torch.Tensor, cs: Rope | None, n_head: int) -> torch.Tensor:
    """`apply_rope` on the first cs-width dimensions of each head of x (B, T, n_head*hd),
    the others passed through (partial RoPE); x itself where there is no rotation (NoPE)."""
    if cs is None:
        return x
    B, T, D = x.shape
    hd, r = D // n_head, cs[0].shape[-1]
    if r == hd:
        return apply_rope(x, cs, n_head)
    xh = x.view(B, T, n_head, hd)
    turned = apply_rope(xh[..., :r].reshape(B, T, n_head * r), cs, n_head).view(B, T, n_head, r)
    return torch.cat([turned, xh[..., r:]], -1).view(B, T, D)
