"""A state's precision: the grid its cached keys and values lie on, and their compact bytes.

A family whose state is a cache of keys and values (`LanguageModel.cache_precisions`) may
keep that cache at a lower precision than it computes in. The rounding happens inside the
model step, as each position is appended (`snap`, which `model.state.Growth` applies to
every row a persistent time axis gains), and every query attends to the rounded rows, its
own chunk's included. A position's stored rows then depend only on the position itself
(its own keys and values, and those it attended to, all rounded the same way), never on
where a chunk or request boundary fell: a text gives the same answer in one request or in
many, at each precision, as in float32.

In memory the cache stays float32, its values on the precision's grid, so the attention
reads it as it always has; its bytes (`pack`) are the compact form, from which `unpack`
gives back the very same floats:

  float32    the floats themselves
  bfloat16   bf16, 2 bytes a value (float16 likewise)
  int8       per position and group of `GROUP` channels, x = q * 2^e with q an int8 in
             [-127, 127] and e one int8 exponent per group: 1 + 1/GROUP bytes a value.

Why int8 with per-token, power-of-two scales. Per-channel key scales (KIVI, Liu et al.,
2024) are fixed only once a group of positions is complete, so the rows a query sees
would depend on how much of the cache was already grouped when it ran, unless the
unfinished group is kept in float and requantised later, changing rows others had seen. A
per-position group is final when the position is appended. Its scale is a power of two,
2^e with e chosen so the group's largest value maps to [64, 128): q * 2^e is then exact in
float32 and e can be recovered from the rounded values alone, so the state needs no scale
tensor in memory and its bytes round-trip bit for bit. The cost (the largest value gets 7
bits, not 8) is measured in docs/BENCHMARKS.md. Nothing here pickles anything.
"""

from __future__ import annotations

import torch

PRECISIONS = ("float32", "bfloat16", "float16", "int8")
GROUP = 32  # channels sharing one int8 exponent (a row narrower than it, or not a multiple, is one group)
SCALE_SUFFIX = ".exp"  # an int8 cache `k` is stored as `k` (int8) and `k.exp` (its int8 exponents)
_FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPONENTS = (-100, 100)  # far beyond any cache's values; keeps 2^e a normal float32


def check(precision: str) -> str:
    """`precision`, or ValueError naming the ones there are."""
    if precision not in PRECISIONS:
        raise ValueError(f"state precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def choose(dtype: str, cache_precisions: tuple[str, ...], family: str) -> tuple[str, str]:
    """What a family does with `--state-dtype dtype`: (its states' precision, the dtype a
    commit rounds them to). A family whose state is a cache of keys and values (its
    `cache_precisions`) keeps the precision in the state, rounded as each row is appended,
    so a commit rounds nothing; any other keeps float32 states, rounded when stored (not to
    int8: ValueError)."""
    check(dtype)
    if dtype in cache_precisions:
        return dtype, "float32"
    if dtype == "int8":
        raise ValueError(
            f"the {family} family's state is not a cache of keys and values: it keeps float32 states, "
            "stored as float32, bfloat16 or float16 (--state-dtype), not int8"
        )
    return "float32", dtype


def group_of(width: int) -> int:
    return GROUP if width % GROUP == 0 else width


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from its bits (exact; e within `_EXPONENTS`)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _exponents(g: torch.Tensor) -> torch.Tensor:
    """Groups (..., n, G) float32 -> the exponent e (..., n, 1) of each group's step 2^e:
    its largest magnitude m * 2^E (m in [0.5, 1)) over 2^(E-7) is in [64, 128)."""
    _, E = torch.frexp(g.abs().amax(-1, keepdim=True))
    return (E - 7).clamp(*_EXPONENTS)


def _groups(x: torch.Tensor) -> torch.Tensor:
    D = x.shape[-1]
    G = group_of(D)
    return x.float().reshape(*x.shape[:-1], D // G, G)


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> q (..., n, G) as float integers in [-127, 127], and e (..., n, 1)."""
    g = _groups(x)
    e = _exponents(g)
    return torch.round(g * _pow2(-e)).clamp_(-127, 127), e


def snap(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Rows (..., D) rounded onto `precision`'s grid, in x's dtype. Idempotent: a row on the
    grid is returned unchanged (to the bit), which a state converted on load relies on."""
    if precision == "float32":
        return x
    if precision in _FLOATS:
        return x.to(_FLOATS[precision]).to(x.dtype)
    q, e = _quantise(x)
    return (q * _pow2(e)).reshape(x.shape).to(x.dtype)


def pack(name: str, x: torch.Tensor, precision: str) -> dict[str, torch.Tensor]:
    """A cache tensor (..., D) on `precision`'s grid -> the tensors its bytes hold, by name."""
    if precision == "float32":
        return {name: x.float()}
    if precision in _FLOATS:
        return {name: x.to(_FLOATS[precision])}
    q, e = _quantise(x)
    return {name: q.to(torch.int8).reshape(x.shape), name + SCALE_SUFFIX: e[..., 0].to(torch.int8)}


def unpack(name: str, stored: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
    """The float32 cache tensor `name` from its stored form (`pack`), bit for bit."""
    t = stored[name]
    if precision != "int8":
        return t.float()
    e = stored[name + SCALE_SUFFIX]
    q = _groups(t)
    return (q * _pow2(e[..., None])).reshape(t.shape)


def packed_names(name: str, precision: str) -> tuple[str, ...]:
    return (name, name + SCALE_SUFFIX) if precision == "int8" else (name,)


# safetensors' names of a cache's stored dtype at each precision
STORED = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8"}


def declared_cache(
    name: str, declared: dict[str, tuple[str, list[int]]], precision: str
) -> tuple[list[int], str | None]:
    """A cache tensor's shape as its blob declares it at `precision`, or (shape, why not):
    its dtype must be the precision's, and an int8 cache's exponents one per group of it."""
    dtype, shape = declared[name]
    if dtype != STORED[precision]:
        return shape, f"state {name} has dtype {dtype}, a {precision} state stores {STORED[precision]}"
    if precision != "int8":
        return shape, None
    scale = declared.get(name + SCALE_SUFFIX)
    if not shape:
        return shape, f"state {name} has no channels"
    want = [*shape[:-1], shape[-1] // group_of(shape[-1])]
    if scale is None or scale[0] != "I8" or scale[1] != want:
        return shape, f"state {name}{SCALE_SUFFIX} must be int8 of shape {want}"
    return shape, None
