"""recur's own CPU kernel (model/kernels): the int4 product in fp32, against float64 products
of the weights rebuilt from the integers and scales, in both of its builds (AVX-512, AVX2)
and both of torch's packed layouts (blocks of 64 rows, AVX-512's, and 32, AVX2's), for the
row counts a decode step and a few streams send."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.int4 import DEQUANT_ROWS, Int4Linear, quantize_groups

G = 32

pytestmark = pytest.mark.skipif(
    kernels.int4_mm() is None, reason="recur's kernel is not built on this machine"
)


def pack(q: torch.Tensor, B: int) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> torch's packed layout with blocks of B rows, written here
    from its description (model/int4.py `block_rows`), not by torch's packer."""
    N, K = q.shape
    blocks = q.view(N // B, B, K).to(torch.uint8)
    low, high = blocks[:, : B // 2], blocks[:, B // 2 :]  # (Nb, B/2, K)
    return (low | high << 4).permute(0, 2, 1).contiguous().view(-1)  # (Nb, K, B/2)


def scales(scale: torch.Tensor, base: torch.Tensor, B: int) -> torch.Tensor:
    """(N, K/G) scales and bases -> the kernel's (N/B, K/G, 2, B)."""
    N, groups = scale.shape
    return torch.stack([scale, base], 1).view(N // B, B, 2, groups).permute(0, 3, 2, 1).contiguous()


ISAS = [
    pytest.param(1, id="avx512", marks=pytest.mark.skipif(not kernels.ISA["avx512"], reason="no AVX-512")),
    pytest.param(0, id="avx2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("B", [64, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, DEQUANT_ROWS - 1])
def test_int4_kernel_is_the_fp32_product(avx512, B, rows, dtype):
    """Within fp32's rounding of the float64 product (measured 3e-7 to 5e-7 of the largest
    output), where bfloat16 activations, as torch's kernel takes them, are off by 1e-3; the
    scales and bases in fp32, or in fp16 (a Q4_1 file's d and m, held as they are)."""
    gen = torch.Generator().manual_seed(rows + B)
    N, K = 3 * B, 5 * G
    q = torch.randint(0, 16, (N, K), generator=gen)
    scale = (torch.rand(N, K // G, generator=gen) * 0.1).to(dtype)
    base = (torch.randn(N, K // G, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, K, generator=gen) * torch.logspace(-2, 2, K)  # (channels of every size)
    w = q.double() * scale.double().repeat_interleave(G, 1) + base.double().repeat_interleave(G, 1)
    ref = x.double() @ w.t()
    y = torch.ops.recur_kernels.int4_mm(x, pack(q, B), scales(scale, base, B), avx512)
    scale, base = scale.float(), base.float()
    assert y.shape == (rows, N) and y.dtype == torch.float32
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 2e-6
    bf16 = (x.bfloat16().double() @ w.t() - ref).abs().max().item() / ref.abs().max().item()
    assert bf16 > 100 * 2e-6  # (the rounding this kernel leaves out, for scale)


def test_int4_layer_takes_the_kernel_for_a_decode_step_and_a_few_streams():
    """`Int4Linear` below `DEQUANT_ROWS` rows: the fp32 product of its weights rebuilt from the
    quantizer's integers, scales and zeros, each row as it would be alone."""
    torch.manual_seed(2)
    w = torch.randn(100, 96)  # 100 rows: padded to the kernel's blocks
    q, scale, zero = quantize_groups(w)
    layer = Int4Linear(q, scale, zero)
    assert layer.kernel is not None and layer.scales_zeros is None and layer.scales.dtype == torch.float32
    ref_w = (q.double() - 8) * scale.double().repeat_interleave(G, 1) + zero.double().repeat_interleave(G, 1)
    x = torch.randn(DEQUANT_ROWS - 1, 96)
    ref = x.double() @ ref_w.t()
    y = layer(x)
    assert y.shape == (DEQUANT_ROWS - 1, 100)
    assert (y.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert (alone - y).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_a_q4_1_files_scales_are_held_in_fp16_as_they_are():
    """A Q4_1 block's d and m are fp16: the layer holds its scales and bases in fp16, exactly
    (w = q d + m), half the bytes of fp32's, and multiplies by them as the fp32 product."""
    torch.manual_seed(4)
    q = torch.randint(0, 16, (64, 96))
    d, m = (torch.rand(64, 3) * 0.1).half().float(), (torch.randn(64, 3) * 0.1).half().float()
    layer = Int4Linear(q, d, m + 8 * d)  # model.int4's w = (q - 8) scale + zero
    assert layer.scales.dtype == torch.float16
    w = q.double() * d.double().repeat_interleave(G, 1) + m.double().repeat_interleave(G, 1)
    x = torch.randn(3, 96)
    ref = x.double() @ w.t()
    assert (layer(x).double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_int4_kernel_in_a_compiled_graph():
    """The operator traces (its output's shape is registered for torch.compile) and the
    compiled layer gives the eager layer's outputs."""
    torch.manual_seed(3)
    q, scale, zero = quantize_groups(torch.randn(64, 64))
    layer = Int4Linear(q, scale, zero)
    x = torch.randn(2, 64)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_the_library_is_loaded_from_where_it_was_built(tmp_path, monkeypatch):
    """The image builds the library into the installed package, which its server's user may
    not write: a build there is loaded from there, not looked for (and rebuilt, without a
    compiler) in the user's cache; without one, the first writable place builds it."""
    import os

    pkg, cache = tmp_path / "package", tmp_path / "cache"
    pkg.mkdir()
    (pkg / f"{kernels.name()}.so").write_bytes(b"")
    monkeypatch.delenv("RECUR_KERNELS_DIR", raising=False)
    monkeypatch.setattr(kernels, "PACKAGE_DIR", pkg)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).startswith(str(pkg)))  # read-only
    assert kernels.directory() == pkg
    (pkg / f"{kernels.name()}.so").unlink()
    assert kernels.directory() == cache / "recur" / "kernels"
    monkeypatch.setenv("RECUR_KERNELS_DIR", str(tmp_path / "elsewhere"))
    assert kernels.directory() == tmp_path / "elsewhere"
