"""The packed weight paths (issue 42): int4 (`model/int4.py`) and int8 (`model/int8.py`),
bfloat16 activations into their kernels. Each is checked against an fp32 reference that
holds the same rounded weights, so what remains is the activations' rounding; and for
boundary invariance: a text in one forward or in chunks (crossing the row counts where a
layer switches products) gives the same greedy tokens and log-probs within tolerance.

The figure on the real file (greedy agreement with fp32 over 50 prompts x 128 tokens) is
`test_smollm2_int4_agrees_with_fp32`, in the slow suite, and bench/llm_packed.py's.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import model
from model import cpu_gemm, kernels
from model.int4 import DEQUANT_ROWS, Int4Linear, quantize_groups
from model.int8 import Int8Embedding, Int8Head, Int8Linear, quantize_rows
from model.llama import Llama

from .conftest import run_chunks
from .llama_files import CONFIG, K_CONFIG, PACKERS, random_weights, write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

# vocab 300: not a multiple of the int4 kernel's block of 64 rows (the head pads)
TINY = dict(
    vocab_size=300, n_layer=2, d_model=64, n_head=4, n_kv_head=2, head_dim=16, d_ff=96,
    sinks=2, window=40, tgt_len=8, rope_base=100.0,
)  # fmt: skip


def tiny(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    lm = model.build("llama", TINY)
    assert isinstance(lm, Llama)
    return lm.eval().requires_grad_(False)


def dequantized_reference(lm: Llama) -> Llama:
    """A copy of a packed model with every packed layer an fp32 `nn.Linear` of the same
    rounded weights (and the lookup a float table): fp32 activations throughout."""
    ref = copy.deepcopy(lm)
    for mod in ref.modules():
        for name, child in list(mod.named_children()):
            if isinstance(child, Int4Linear):
                w = child.dequantized()
            elif isinstance(child, Int8Linear):
                w = child.q.float() * child.scale[:, None]
            elif isinstance(child, Int8Head):
                w = torch.cat(list(child.exact.dequantized()))
            elif isinstance(child, Int8Embedding):
                table = torch.cat(list(child.table.dequantized()))
                setattr(mod, name, nn.Embedding.from_pretrained(table))
                continue
            else:
                continue
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight = nn.Parameter(w, requires_grad=False)
            setattr(mod, name, linear)
    ref.precision = "fp32"
    return ref


@pytest.fixture(params=[True, False], ids=["low-precision-gemm", "fp32-gemm"])
def gemm(request, monkeypatch) -> bool:
    """Both many-row products on any CPU (model/cpu_gemm.py): the bfloat16 and int8 GEMMs a
    CPU with AVX-512 / VNNI / AMX takes, and the fp32 GEMM one without them takes."""
    monkeypatch.setattr(cpu_gemm, "BF16_GEMM", request.param)
    monkeypatch.setattr(cpu_gemm, "INT8_GEMM", request.param)
    return request.param


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


@pytest.mark.parametrize("recurs", [True, False], ids=["recur-kernel", "torch-kernel"])
def test_int4_groups_round_trip_and_both_products_agree(gemm, recurs, monkeypatch):
    """A layer's weights within half a step of the group's grid; the few-row kernel (recur's,
    or torch's where recur's is not built) and the dequantized GEMM agree within bfloat16."""
    if not recurs:
        monkeypatch.setattr(kernels, "int4_mm", lambda: None)
    torch.manual_seed(0)
    w = torch.randn(100, 96)  # 100 rows: padded to the kernel's 128
    q, scale, zero = quantize_groups(w)
    layer = Int4Linear(q, scale, zero)
    if not recurs:  # (torch's kernel, with its own bfloat16 scales, is what runs below)
        assert layer.kernel is None and layer.scales_zeros is not None
    step = scale.repeat_interleave(32, 1)
    assert ((layer.dequantized() - w).abs() <= 0.5 * step + 0.02 * w.abs().amax()).all()
    x = torch.randn(2 * DEQUANT_ROWS, 96)
    ref = x @ layer.dequantized().t()
    many, few = layer(x), torch.cat([layer(x[i : i + 4]) for i in range(0, len(x), 4)])
    assert many.shape == (2 * DEQUANT_ROWS, 100) and many.dtype == torch.float32
    assert close(many, ref, 0.02) and close(few, ref, 0.02)


def test_int4_dequantization_puts_each_weight_in_place_rounded_once():
    """What the many-row GEMM multiplies by: each weight (q - 8) scale + zero from its own
    nibble, in its own place of W^T, computed in fp32 (the fp32 GEMM's weights, within a
    few fp32 steps of the exact value) and rounded to bfloat16 once (a chain of bfloat16
    operations would round it three times)."""
    torch.manual_seed(1)
    N, K = 100, 96  # padded to the kernel's 128 rows
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    scale, zero = torch.rand(N, K // 32) * 0.1, torch.randn(N, K // 32) * 0.1
    layer = Int4Linear(q, scale, zero)
    s, z = (t.double().repeat_interleave(32, 1) for t in (scale, zero))  # fp32, as the layer holds them
    exact = (q.double() - 8) * s + z  # (N, K)
    fp32 = layer.dequantized_t(torch.float32)
    assert fp32.shape == (K, 128) and (fp32[:, N:] == 0).all()
    assert ((fp32[:, :N].t().double() - exact).abs() <= 4 * 2.0**-24 * exact.abs().amax()).all()
    assert torch.equal(layer.dequantized_t(torch.bfloat16), fp32.bfloat16())


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_packed_path_matches_its_dequantized_reference(precision, gemm):
    """The packed kernels with bfloat16 activations against fp32 products of the very same
    rounded weights: the activations' rounding only, a percent of the logits at most, and
    the greedy tokens (nearly) all alike."""
    lm = tiny(seed=3)
    lm.quantize(precision)
    assert lm.precision == precision and isinstance(lm.tok_emb, Int8Embedding)
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in lm.parameters())  # no fp32 matrix
    ref = dequantized_reference(lm)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 60), generator=torch.Generator().manual_seed(3))
    ours, theirs = lm(tokens)[0], ref(tokens)[0]
    assert close(ours, theirs, 0.02)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_packed_path_is_boundary_invariant(precision, gemm):
    """One forward against chunks of every size a server runs (decode's single tokens, a few
    rows, chunks past `DEQUANT_ROWS` and int8's `PACKED_ROWS`), and batched against alone:
    the same greedy tokens and log-probs within bfloat16's tolerance."""
    lm = tiny(seed=5)
    lm.quantize(precision)
    tokens = torch.randint(0, TINY["vocab_size"], (1, 120), generator=torch.Generator().manual_seed(5))
    whole, _ = lm(tokens)
    chunked, _ = run_chunks(lm, tokens, [1, 1, 3, 9, 50, 2, 1, 53])
    logp_whole, logp_chunked = whole.log_softmax(-1), chunked.log_softmax(-1)
    assert (logp_whole - logp_chunked).abs().max().item() <= 0.05
    assert (whole.argmax(-1) == chunked.argmax(-1)).float().mean().item() >= 0.98
    pair = torch.cat([tokens, tokens.flip(1)])
    assert close(lm(pair)[0][:1], whole, 0.02)


@pytest.mark.parametrize("precision", ["int4", "int4-torch", "int8"])
def test_without_low_precision_units_many_rows_are_an_fp32_product(precision, monkeypatch):
    """On a CPU without bfloat16 or int8 units (model/cpu_gemm.py) a many-row product is the
    fp32 rows times the fp32 weights, built here from the quantizer's own integers and
    scales: equal to fp32's rounding (within 2e-6 of the largest output; measured 3e-7),
    where the bfloat16 and 14-bit products are off by more than 1e-5 (int8's measured 5e-5).
    Beside recur's int4 kernel the many-row product is fp32's on every CPU; beside torch's
    ("int4-torch": where recur's kernel is not built) it takes the CPU's bfloat16 units."""
    monkeypatch.setattr(cpu_gemm, "BF16_GEMM", False)
    monkeypatch.setattr(cpu_gemm, "INT8_GEMM", False)
    if precision == "int4-torch":
        monkeypatch.setattr(kernels, "int4_mm", lambda: None)
    torch.manual_seed(1)
    w, x = torch.randn(100, 96), torch.randn(2 * DEQUANT_ROWS, 96)
    if precision.startswith("int4"):
        q, scale, zero = quantize_groups(w)
        layer: nn.Module = Int4Linear(q, scale, zero)
        s, z = (t.double().repeat_interleave(32, 1) for t in (scale, zero))
        ref_w = (q.double() - 8) * s + z
    else:
        q, scale = quantize_rows(w)
        layer = Int8Linear(q, scale)
        ref_w = q.double() * scale.double()[:, None]
    ref = x.double() @ ref_w.t()
    assert (layer(x).double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    monkeypatch.setattr(cpu_gemm, "BF16_GEMM", True)
    monkeypatch.setattr(cpu_gemm, "INT8_GEMM", True)
    off = (layer(x).double() - ref).abs().max().item()
    if precision == "int4" and kernels.int4_mm() is not None:
        assert off <= 2e-6 * ref.abs().max().item()
    else:
        assert off > 1e-5 * ref.abs().max().item()


def _range(g: np.ndarray) -> np.ndarray:  # (the range holding 0 of each group: d sc q - dmin m)
    return np.maximum(g.max(-1), 0) - np.minimum(g.min(-1), 0)


# type -> (weights a group, its grid's step, the most a weight may lie off it in steps)
K_GRIDS = {
    "Q2_K": (16, lambda g: _range(g) / 3, 0.75),
    "Q3_K": (16, lambda g: np.abs(g).max(-1) / 4, 1.05),  # q in [-4, 3]: the far side clips at 3 steps
    "Q4_K": (32, lambda g: _range(g) / 15, 0.75),
    "Q5_K": (32, lambda g: _range(g) / 31, 0.75),
    "Q6_K": (16, lambda g: np.abs(g).max(-1) / 31.5, 0.75),
    # a non-uniform table of 16 values over [-127, 113] x d: its widest gap, 24 d
    "IQ4_NL": (32, lambda g: np.abs(g).max(-1) / 127 * 24, 0.75),
    "IQ4_XS": (32, lambda g: np.abs(g).max(-1) / 127 * 24, 0.75),
}


@pytest.mark.parametrize("qtype", K_GRIDS)
def test_the_tests_k_quant_blocks_read_back_near_their_weights(qtype):
    """The K-quant files the tests write (tests/model/llama_files.py packs their blocks: `gguf`
    has no writer for them) hold what they were given: ggml's own reader (`gguf.quants`)
    gives back each weight within rounding of its group's grid (measured: 0.51-0.66 of a
    step at most, Q3_K 0.90, 0.15-0.24 on average). A packer that put a super-block's codes
    in another order lands 4 to 18 steps off on average."""
    from gguf import GGMLQuantizationType, quants

    group, step, most = K_GRIDS[qtype]
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.15
    back = quants.dequantize(PACKERS[qtype](w), GGMLQuantizationType[qtype]).reshape(w.shape)
    err = np.abs(back - w) / np.repeat(step(w.reshape(16, -1, group)), group, -1).reshape(w.shape)
    assert err.max() <= most and err.mean() <= 0.3


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q4_K"])
def test_gguf_q4_blocks_are_packed_as_they_are(tmp_path, qtype):
    """A Q4 file read packed: each layer is the file's own blocks (against the fp32 read's
    dequantized weights: bfloat16's rounding of the scales, nothing more; Q4_K's super-blocks
    in K_CONFIG's shape, whose rows hold whole ones). The logits stay near the fp32 read's: this random model's peaked logits
    (std 0.15 weights) magnify the activations' rounding far more than a trained one's, so
    the bound is loose here; test_packed_path_matches_its_dequantized_reference is the tight one."""
    cfg = K_CONFIG if qtype.endswith("_K") else CONFIG
    path = write_gguf(tmp_path / f"tiny.{qtype}.gguf", random_weights(seed=2, cfg=cfg), qtype, cfg=cfg)
    fp32 = model.load(path, device="cpu", precision="fp32")
    int4 = model.load(path, device="cpu", precision="int4")
    assert int4.precision == "int4"
    for i in range(cfg["n_layer"]):
        for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down"):
            packed = int4.get_submodule(f"layers.{i}.{name}")
            assert isinstance(packed, Int4Linear)
            w = fp32.get_submodule(f"layers.{i}.{name}").weight
            assert (packed.dequantized() - w).abs().max().item() <= 0.01 * w.abs().max().item()
    tokens = torch.randint(0, cfg["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    ours, theirs = int4(tokens)[0], fp32(tokens)[0]
    assert close(ours, theirs, 0.1)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.85


def test_gguf_q4_k_m_mix_is_read_packed_and_in_fp32(tmp_path):
    """llama.cpp's Q4_K_M mixes types: Q4_K, with attn_v, ffn_down and the embedding in Q6_K.
    Read packed in int4, each layer joins its parts in one `Int4Linear` (the Q4_K parts' blocks
    as they are, the Q6_K ones quantized per group of 32 from their 6 bits: within a 4-bit
    step of the file's weights); in int8 rows; and in fp32. All three agree on the greedy
    token at most positions."""
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
    path = write_gguf(
        tmp_path / "tiny.Q4_K_M.gguf", random_weights(seed=3, cfg=K_CONFIG), "Q4_K", cfg=K_CONFIG, types=mix
    )
    fp32, int8, int4 = (model.load(path, device="cpu", precision=p) for p in ("fp32", "int8", "int4"))
    for i in range(K_CONFIG["n_layer"]):
        for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down"):
            packed = int4.get_submodule(f"layers.{i}.{name}")
            assert isinstance(packed, Int4Linear)
            w = fp32.get_submodule(f"layers.{i}.{name}").weight
            step = 0.01 if name in ("attn.proj", "mlp.gate_up") else 1 / 15  # Q4_K's own, or requantized
            assert (packed.dequantized() - w).abs().max().item() <= step * w.abs().max().item()
    tokens = torch.randint(0, K_CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    theirs = fp32(tokens)[0].argmax(-1)
    for packed in (int8, int4):
        assert (packed(tokens)[0].argmax(-1) == theirs).float().mean().item() >= 0.85


@pytest.mark.parametrize(
    ("qtype", "mix"),
    [("Q3_K", {"attn_v": "Q5_K", "ffn_down": "Q4_K"}), ("Q2_K", {"attn_v": "Q3_K", "ffn_down": "Q3_K"})],
    ids=["Q3_K_M", "Q2_K"],
)
def test_gguf_files_of_fewer_bits_are_read_packed_near_their_fp32_read(tmp_path, qtype, mix):
    """Files of 2- and 3-bit K-quants (llama.cpp's Q3_K_M and Q2_K mixes) read packed: in int4
    every layer quantized per group of 32 (the Q4_K part as it is), within a 4-bit step of
    the file's weights; int8 and int4 pick the fp32 read's greedy token at most positions."""
    path = write_gguf(
        tmp_path / f"tiny.{qtype}.gguf", random_weights(seed=6, cfg=K_CONFIG), qtype, cfg=K_CONFIG, types=mix
    )
    fp32, int8, int4 = (model.load(path, device="cpu", precision=p) for p in ("fp32", "int8", "int4"))
    for i in range(K_CONFIG["n_layer"]):
        for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down"):
            w = fp32.get_submodule(f"layers.{i}.{name}").weight
            packed = int4.get_submodule(f"layers.{i}.{name}").dequantized()
            assert (packed - w).abs().max().item() <= w.abs().max().item() / 15
    tokens = torch.randint(0, K_CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    theirs = fp32(tokens)[0].argmax(-1)
    for packed in (int8, int4):
        assert (packed(tokens)[0].argmax(-1) == theirs).float().mean().item() >= 0.85


def test_an_iq4_file_read_in_int4_says_that_int8_keeps_it(tmp_path, caplog):
    """IQ4_NL and IQ4_XS place their 16 levels unevenly: an int4 read rounds them again (1.43x
    the perplexity on the shipped model's IQ4_XS file, docs/BENCHMARKS.md), so it warns and
    names int8; the int8 read, which keeps them, and a Q4_K file's int4 read do not warn."""
    iq4 = write_gguf(
        tmp_path / "tiny.IQ4_XS.gguf", random_weights(seed=7, cfg=K_CONFIG), "IQ4_XS", cfg=K_CONFIG
    )
    q4k = write_gguf(tmp_path / "tiny.Q4_K.gguf", random_weights(seed=7, cfg=K_CONFIG), "Q4_K", cfg=K_CONFIG)
    with caplog.at_level("WARNING", logger="model.llama_gguf"):
        model.load(iq4, device="cpu", precision="int4")
    assert "14 matrices are i-quants" in caplog.text and "precision int8 keeps them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="model.llama_gguf"):
        model.load(iq4, device="cpu", precision="int8")
        model.load(q4k, device="cpu", precision="int4")
    assert "i-quants" not in caplog.text


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_a_gguf_tensor_type_not_read_is_refused_whole(tmp_path, precision):
    """A file holding a type this reader does not read (TQ1_0, ternary) is refused by name,
    before any tensor is read, on every path."""
    path = write_gguf(
        tmp_path / "tiny.TQ1_0.gguf", random_weights(seed=5, cfg=K_CONFIG), "TQ1_0", cfg=K_CONFIG
    )
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight is TQ1_0; supported: F32, .*Q4_K"):
        model.load(path, device="cpu", precision=precision)


@pytest.mark.parametrize(
    ("qtype", "types", "exact"),
    [
        ("Q4_1", {"token_embd": "Q8_0"}, True),  # the shipped file's types
        ("Q4_0", {"token_embd": "Q8_0"}, True),
        ("Q4_1", {"token_embd": "Q8_0", "attn_v": "Q6_K"}, False),  # one matrix an int4 read rounds again
        ("Q4_1", {"token_embd": "F16"}, False),  # a token table the int8 blocks round again
        ("Q5_0", {"token_embd": "Q8_0"}, False),
    ],
)
def test_auto_serves_int4_where_it_keeps_the_files_weights(tmp_path, qtype, types, exact):
    """`--precision auto` on a CPU: int4 for a file whose int4 read keeps every weight as the
    file holds it (and recur's fp32 kernel is built here), fp32 for any other. Served so, it
    gives the fp32 read's greedy tokens and, at them, its log-probs within 1e-3 (the head's
    other logits come from its per-row int8 table: model/int8.py)."""
    cfg = K_CONFIG
    path = write_gguf(
        tmp_path / f"tiny.{qtype}.gguf", random_weights(seed=9, cfg=cfg), qtype, cfg=cfg, types=types
    )
    auto = model.load(path, device="cpu")
    assert auto.precision == ("int4" if exact and kernels.int4_mm() is not None else "fp32")
    if auto.precision != "int4":
        return
    fp32 = model.load(path, device="cpu", precision="fp32")
    tokens = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(9))
    ours, theirs = auto(tokens)[0].log_softmax(-1), fp32(tokens)[0].log_softmax(-1)
    picks = theirs.argmax(-1, keepdim=True)
    assert torch.equal(ours.argmax(-1, keepdim=True), picks)
    assert (ours.gather(-1, picks) - theirs.gather(-1, picks)).abs().max().item() <= 1e-3


def test_gguf_float_file_is_quantized_to_int4_on_request(tmp_path):
    """A float file's layers quantized per group; serving options in the packed fingerprint."""
    path = write_gguf(tmp_path / "tiny.f16.gguf", random_weights(seed=4), "F16")
    lm = model.load(path, device="cpu", precision="int4", options="window=30")
    assert isinstance(lm.get_submodule("layers.0.mlp.down"), Int4Linear)
    assert lm.fingerprint != model.load(path, device="cpu", precision="int4").fingerprint


def bench(name: str):
    """A bench/ script as a module: the figures in docs/BENCHMARKS.md come from its functions."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    return importlib.import_module(name)


@pytest.mark.slow
@pytest.mark.skipif(kernels.int4_mm() is None, reason="recur's int4 kernel is not built here: torch's, bf16")
@pytest.mark.timeout(1500)  # (beside make test-slow's other worker it outlasted 600 s, which xfail then hid)
def test_smollm2_int4_agrees_with_fp32():
    """Issue 42's quality bound on the shipped file: greedy tokens identical to the fp32
    path's (the same file, dequantized) for at least 95% of 50 prompts x 128 tokens.
    Measured 1.0 with recur's fp32 kernel (every token of every prompt); 0.877 through
    torch's kernel, whose bfloat16 activations and output kept it below the bound."""
    assert bench("llm_packed").agreement("int4", prompts=50, tokens=128) >= 0.95


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smollm2_int4_picks_fp32s_token_from_fp32s_history():
    """What the free-running bound cannot tell from chance (one flip at a near tie sends a
    row its own way for good): teacher-forced on the fp32 path's greedy tokens, int4 picks
    fp32's token at 99.5% of the 50 x 128 positions or more. Measured 0.9986; llama.cpp's
    own path on the same file 0.9944, recur's int8 0.9945 (docs/BENCHMARKS.md). Planted
    (16 x 64): every layer's scales 2% off gives 0.977, one layer's zeros without Q4_1's
    8d 0.825; one layer's scales 2% off stays within it (0.998)."""
    assert bench("llm_packed").agreement("int4", prompts=50, tokens=128, forced=True) >= 0.995


STUDY_TOKENS = 20_000  # of the held-out study's 105,000 (bench/llm_quality.py reads them all)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_int4_perplexity_is_within_1pct_of_fp32():
    """Issue 42's perplexity bound: int4 as served (the file's Q4_1 blocks packed, bf16
    activations) within 1% of the fp32 path's perplexity on the held-out plays, each read by
    one session. The test reads the study's first 20,000 tokens (minutes a path on one
    thread); `python bench/llm_quality.py --only formats` reads all 105,000 (docs/BENCHMARKS.md,
    section 10: +0.06%). Planted over 3,000 tokens: one layer's zeros without Q4_1's 8d move
    it by +104%."""
    quality = bench("llm_quality")
    ids = quality.held_out(quality.load(1024))[:STUDY_TOKENS]
    skip = torch.zeros(len(ids), dtype=torch.bool)
    skip[0] = True  # (no context)
    fp32 = quality.ppl(quality.stream(quality.load(1024), ids), skip)
    int4 = quality.ppl(quality.stream(quality.load(1024, precision="int4"), ids), skip)
    assert abs(int4 / fp32 - 1) <= 0.01, (int4, fp32)
