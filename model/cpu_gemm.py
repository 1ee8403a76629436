"""Which many-row products this CPU runs on units of its own: the packed layers' prefill
products (`model/int8.py`, `model/int4.py`) pick by it.

From a few dozen rows on (a prompt's chunk, a large batch), the packed layers multiply all
their rows at once: int4 in bfloat16 (its weights dequantized for the call), int8 in int8
(`torch._int_mm`). oneDNN runs those on the CPU's AVX-512 (bfloat16) and VNNI or AMX (int8)
units; without them it falls back to a loop far slower than an fp32 GEMM. On the 2-core AMD
EPYC with AVX2 only, a 512 x 576 x 1536 product took 715 ms in bfloat16 and 338 ms in int8
against 7.9 ms in fp32 (`bench/packed_gemm.py`, 2 threads), and int4's prompt processing ran
at 5.9 tokens/s against fp32's 366 (`bench/llm_peers.py`). Where the units are missing, the layers
multiply the fp32 rows by the fp32 weights they dequantize for the call instead: exact
weights, the inputs unrounded, so no less accurate than the products they stand in for.

The flags are read once, at import; tests set them to run either product on any CPU.
"""

from __future__ import annotations

import torch

AMX = torch.cpu._is_amx_tile_supported()
BF16_GEMM = torch.cpu._is_avx512_supported() or AMX  # a bfloat16 GEMM runs natively
INT8_GEMM = torch.cpu._is_vnni_supported() or AMX  # `torch._int_mm` runs natively
