"""GGUF files (llama.cpp's format) of LLaMA-architecture models, read with ggml's own `gguf`
package into the `llama` family (`model/llama.py`).

    lm = read(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))    # model.load takes the path too
    template = chat_template(path)                          # the metadata's, with its stops

What is read:
  * the weights, dequantized to fp32 by the `gguf` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, the K-quants Q2_K to Q6_K, which llama.cpp's Q2_K, Q3_K_S/M/L, Q4_K_S/M,
    Q5_K_S/M and Q6_K files mix, and IQ4_NL and IQ4_XS), or packed (`read_packed`: Q4_0,
    Q4_1 and Q4_K blocks as they are, any other type quantized per group or per row).
    llama.cpp stores the q and k projections with their rows permuted (its RoPE rotates
    adjacent pairs, HF's and ours rotate halves: convert_hf_to_gguf.py's `permute`);
    `unpermute` undoes it, which the parity tests against HF transformers prove;
  * the config from the `{arch}.*` keys (a file with RoPE scaling is refused: this family
    implements plain RoPE);
  * the tokenizer from the `tokenizer.ggml.*` keys, built with the `tokenizers` library the
    way transformers builds it: a byte-level BPE of the file's tokens and merges, its
    pre-tokenizer picked by `tokenizer.ggml.pre`, the control tokens as special tokens and
    the user-defined ones as added tokens; BOS only when `add_bos_token` says so;
  * the chat template (`tokenizer.chat_template`), whose turn stop is the text of the EOS
    token and of the end-of-turn token, if the file names one.

Its reader (`READER`) claims a `.gguf` file. Nothing here unpickles; the file is
memory-mapped and read once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .chat_template import ChatTemplate
from .gguf_metadata import metadata, of_reader
from .int4 import Int4Linear, quantize_groups
from .int8 import Int8Blocks, Int8Linear, quantize_blocks, quantize_rows
from .llama import LAYER, Llama, LlamaConfig, layer_weights, serving_span
from .native import build
from .norms import RMSNorm
from .reader import Reader
from .tokenizer import BPETokenizer

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama",)
# llama.cpp's hybrid architectures, which recur serves from their HF checkpoints only
# (`model/hf_hybrid.py`): -> (the model, recur's family)
HYBRIDS = {
    "qwen35": ("Qwen3.5", "gdn-hybrid"),
    "qwen35moe": ("Qwen3.5 MoE", "gdn-hybrid"),
    "qwen3next": ("Qwen3-Next", "gdn-hybrid"),
    "granitehybrid": ("Granite-4.0-H", "mamba2-hybrid"),
    "nemotron_h": ("Nemotron-H", "mamba2-hybrid"),
}
# the tensor types read (the `gguf` package dequantizes them): the float ones, llama.cpp's
# legacy blocks of 32, the K-quants in super-blocks of 256 that its Q*_K_S/M/L files mix, and
# the 4-bit i-quants (a non-uniform table of 16 values) of its IQ4_NL and IQ4_XS files
SUPPORTED_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
SUPPORTED_TYPES += ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # per 32 weights: d (f16)[, m (f16)], 16 bytes of nibbles
UNEVEN = ("IQ4_NL", "IQ4_XS")  # 16 levels from a table: no even int4 grid holds them
QK_K = 256  # weights in a K-quant super-block
Q4_K_BYTES = 144  # a Q4_K super-block: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles
PACKED = ("int8", "int4")  # the weight precisions `read` packs from the file itself
INT4_EXACT = (*Q4_BLOCK_BYTES, "Q4_K")  # the types an int4 read packs as they are (`int4_groups`)
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# tokenizer.ggml.pre -> how text is split before the merges (llama.cpp's pre-tokenizer types)
GPT2_SPLIT = None  # the ByteLevel pre-tokenizer's own GPT-2 regex
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {  # name -> (split regex, digits one by one)
    "default": (GPT2_SPLIT, False),
    "gpt2": (GPT2_SPLIT, False),
    "smollm": (GPT2_SPLIT, True),
    "llama3": (LLAMA3_SPLIT, False),
    "llama-bpe": (LLAMA3_SPLIT, False),
    "llama-v3": (LLAMA3_SPLIT, False),
}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


class GGUF:
    """A GGUF file's metadata (by key) and tensors (by name), memory-mapped."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        of_reader(path, self.reader)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")
        if self.arch in HYBRIDS:
            name, family = HYBRIDS[self.arch]
            raise ValueError(
                f"{path}: a {name} hybrid (GGUF architecture {self.arch!r}). recur serves it from its HF "
                f"checkpoint (`recur convert HF_DIR DST`, or `--model HF_DIR`), not from GGUF: this reader "
                f"lacks the mapping of llama.cpp's recurrent-layer tensors (ssm_*, their conv, decay and "
                f"grouped projections as its converter stores them) onto the {family} family, and has no "
                "reference file to check one against"
            )
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{path}: architecture {self.arch!r} is not a LLaMA one ({', '.join(ARCHITECTURES)})"
            )
        other = next((t for t in self.reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES), None)
        if other is not None:  # (refused whole, before any tensor is read, whatever the precision)
            raise ValueError(
                f"{path}: tensor {other.name} is {other.tensor_type.name}; supported: {', '.join(SUPPORTED_TYPES)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def weight(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to fp32, in torch's layout ((out, in) for a matrix)."""
        from gguf import quants

        t = self.tensors[name]
        data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = [int(d) for d in reversed(t.shape)]  # ggml lists dimensions fastest first
        return torch.from_numpy(data.reshape(shape).copy())

    def int4_groups(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_0, Q4_1 or Q4_K matrix's blocks as they are: q (N, K) uint8 in [0, 15], and the
        scale and zero (N, K/32) of `model.int4`'s w = (q - 8) scale + zero (Q4_1's
        w = q d + m: scale d, zero m + 8d; Q4_0's w = (q - 8) d: zero 0; Q4_K's, `q4_k_groups`).
        None for any other type."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        K, N = (int(d) for d in t.shape)
        if kind == "Q4_K":
            return q4_k_groups(np.asarray(t.data).reshape(N, K // QK_K, Q4_K_BYTES))
        if kind not in Q4_BLOCK_BYTES:
            return None
        b = np.asarray(t.data).reshape(N, K // 32, Q4_BLOCK_BYTES[kind])
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m, nibbles = (
                np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32),
                b[..., 4:],
            )
        else:
            m, nibbles = -8 * d, b[..., 2:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], -1).reshape(N, K)  # low nibbles: the first 16
        return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m + 8 * d)

    def int8_rows(self, name: str, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """A matrix as int8 rows and their scales (`model.int8.quantize_rows`), dequantized
        `chunk` rows at a time (a 49k-token embedding never whole in fp32)."""
        from gguf import quants

        t = self.tensors[name]
        qs, scales = [], []
        for i in range(0, int(t.shape[1]), chunk):
            rows = np.asarray(quants.dequantize(t.data[i : i + chunk], t.tensor_type), dtype=np.float32)
            q, s = quantize_rows(torch.from_numpy(rows.reshape(-1, int(t.shape[0]))))
            qs.append(q)
            scales.append(s)
        return torch.cat(qs), torch.cat(scales)

    def int8_blocks(self, name: str, chunk: int = 4096) -> Int8Blocks:
        """A matrix as int8 blocks of 32 (`model.int8.Int8Blocks`): a Q8_0 tensor's blocks as
        they are (scale d, its 32 int8), any other type quantized per block `chunk` rows at a time."""
        from gguf import quants

        t = self.tensors[name]
        K, N = (int(d) for d in t.shape)
        if t.tensor_type.name == "Q8_0":
            b = np.asarray(t.data).reshape(N, K // 32, 34)  # d (f16), then 32 int8
            d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
            codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(N, K)
            return Int8Blocks(torch.from_numpy(codes), torch.from_numpy(d))
        qs, scales = [], []
        for i in range(0, N, chunk):
            rows = np.asarray(quants.dequantize(t.data[i : i + chunk], t.tensor_type), dtype=np.float32)
            q, s = quantize_blocks(torch.from_numpy(rows.reshape(-1, K)))
            qs.append(q)
            scales.append(s)
        return Int8Blocks(torch.cat(qs), torch.cat(scales))


def q4_k_groups(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (N, K/256, 144 bytes) -> q (N, K) in [0, 15] and the scale and zero
    (N, K/32) of `model.int4`'s groups. A super-block holds 8 groups of 32 weights, group j's
    w = d sc_j q - dmin m_j (ggml's dequantize_row_q4_K: sc_j and m_j 6-bit, d and dmin f16),
    so scale = d sc_j and zero = 8 d sc_j - dmin m_j; its nibbles come 32 bytes to two groups,
    the low ones group 2p's and the high ones group 2p + 1's. The 6-bit scales are unpacked
    by the `gguf` package's own `Q4_K.get_scale_min`."""
    from gguf.quants import Q4_K

    N, S, _ = b.shape
    d, dmin = (
        np.ascontiguousarray(b[..., i : i + 2]).view(np.float16)[..., 0].astype(np.float32) for i in (0, 2)
    )
    sc, m = (
        x.reshape(N, S, 8).astype(np.float32) for x in Q4_K.get_scale_min(b[..., 4:16].reshape(N * S, 12))
    )
    scale = d[..., None] * sc
    zero = 8 * scale - dmin[..., None] * m
    halves = b[..., 16:].reshape(N, S, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    q = (halves & 15).reshape(N, S * QK_K)  # (N, S, 4 pairs, 2 groups, 32) in the weights' order
    return torch.from_numpy(q), torch.from_numpy(scale.reshape(N, -1)), torch.from_numpy(zero.reshape(N, -1))


GGUF_PARTS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
    "norm1": "attn_norm",
    "norm2": "ffn_norm",
}  # model.llama.LAYER's parts, as GGUF names them in a layer's `blk.{i}.`


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a q or k projection (n_head of its heads): within
    each head, rows (0, 2, 4, ..., 1, 3, 5, ...) of HF's layout were interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def native_config(f: GGUF) -> dict[str, Any]:
    """The `LlamaConfig` fields the file's metadata states."""
    if (f.arch_key("rope.scaling.type") or "none") != "none" or "rope_freqs.weight" in f.tensors:
        raise ValueError(f"{f.path}: RoPE scaling is not supported (this family implements plain RoPE)")
    n_head = f.arch_key("attention.head_count")
    d_model = f.arch_key("embedding_length")
    trained = f.arch_key("context_length", 0)
    cfg = {
        "vocab_size": len(f.get("tokenizer.ggml.tokens") or []) or f.arch_key("vocab_size"),
        "n_layer": f.arch_key("block_count"),
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": f.arch_key("attention.head_count_kv", n_head),
        "head_dim": f.arch_key("attention.key_length")
        or f.arch_key("rope.dimension_count")
        or d_model // n_head,
        "d_ff": f.arch_key("feed_forward_length"),
        "rope_base": float(f.arch_key("rope.freq_base", 10000.0)),
        "norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_weights": "output.weight" not in f.tensors,
        "trained_context": trained,
    }
    return {**cfg, **serving_span(trained, f.arch_key("attention.sliding_window"))}


def state_dict(f: GGUF, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The family's weights from the file's tensors (q and k rows un-permuted)."""
    out = {"tok_emb.weight": f.weight("token_embd.weight"), "norm_out.weight": f.weight("output_norm.weight")}
    out["head.weight"] = out["tok_emb.weight"] if cfg["tie_weights"] else f.weight("output.weight")
    for i in range(cfg["n_layer"]):
        out.update(layer_weights(f"layers.{i}.", functools.partial(layer_part, f, cfg, i)))
    return out


def layer_part(f: GGUF, cfg: dict[str, Any], layer: int, part: str) -> torch.Tensor:
    """One of model.llama.LAYER's parts of a layer, q and k rows un-permuted."""
    w = f.weight(f"blk.{layer}.{GGUF_PARTS[part]}.weight")
    heads = {"q": cfg["n_head"], "k": cfg["n_kv_head"]}.get(part)
    return w if heads is None else unpermute(w, heads)


def packed_layer(
    f: GGUF, cfg: dict[str, Any], layer: int, parts: tuple[str, ...], precision: str
) -> nn.Module:
    """One of model.llama.LAYER's linears of a layer (its parts joined), packed: int4 from
    the file's Q4_0, Q4_1 and Q4_K blocks as they are (any other type quantized per group
    from its dequantized weights), or int8 rows."""
    heads = {"q": cfg["n_head"], "k": cfg["n_kv_head"]}
    pieces = []  # each part's (q, scale) or (q, scale, zero), q and k rows un-permuted
    for part in parts:
        name = f"blk.{layer}.{GGUF_PARTS[part]}.weight"
        if precision == "int8":
            xs = list(f.int8_rows(name))
        else:
            xs = list(f.int4_groups(name) or quantize_groups(f.weight(name)))
        pieces.append([unpermute(x, heads[part]) for x in xs] if part in heads else xs)
    joined = [torch.cat(xs) for xs in zip(*pieces, strict=True)]
    return Int8Linear(*joined) if precision == "int8" else Int4Linear(joined[0], joined[1], joined[2])


def read_packed(path: Path, precision: str) -> Llama:
    """The model in the GGUF file `path` with its block weights packed (`precision` int4 or
    int8, CPU, eval mode): no layer is ever held in fp32 (int4 from Q4_0, Q4_1 and Q4_K
    blocks: never dequantized). Its norms are fp32; its head and token lookup int8 in blocks
    of 32, a Q8_0 table as it is (`Llama.set_packed_ends`).
    Its fingerprint hashes the file's tensors as stored."""
    f = GGUF(path)
    cfg = native_config(f)
    blocks = [t for t in f.reader.tensors if t.name.startswith("blk.")]  # (the int4 layers' own)
    uneven = sum(t.tensor_type.name in UNEVEN for t in blocks) if precision == "int4" else 0
    if uneven:
        log.warning(
            "%s: %d matrices are i-quants (IQ4_NL, IQ4_XS), whose 16 uneven levels an int4 read rounds "
            "again to an even grid; precision int8 keeps them (docs/BENCHMARKS.md, 'Quantized files "
            "from llama.cpp', measures both)",
            path,
            uneven,
        )
    with torch.device("meta"):
        lm = Llama(LlamaConfig(**cfg))
    for i, blk in enumerate(lm.blocks()):
        blk.attn.qkv, blk.attn.proj, blk.mlp.gate_up, blk.mlp.down = (
            packed_layer(f, cfg, i, LAYER[name], precision)
            for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down")
        )
        for part, norm in (("norm1", blk.norm1), ("norm2", blk.norm2)):
            set_norm(norm, f.weight(f"blk.{i}.{GGUF_PARTS[part]}.weight"))
    set_norm(lm.norm_out, f.weight("output_norm.weight"))
    embedding = f.int8_blocks("token_embd.weight")
    lm.set_packed_ends(embedding if cfg["tie_weights"] else f.int8_blocks("output.weight"), embedding)
    lm.precision = precision
    lm.tokenizer = tokenizer(f)
    lm.fingerprint = stored_fingerprint(f, lm)
    return lm.eval()


def exact_packs(path: Path) -> tuple[str, ...]:
    """The packed precisions whose weights are the file's own, exactly: int4 where every
    matrix of the layers is Q4_0, Q4_1 or Q4_K (packed as they are, their scales held
    exactly: `model.int4`) and the token table (and head) Q8_0 (`Int8Blocks` as it is), as in
    the shipped SmolLM2 file. Any other type is rounded again by a packed read."""
    tensors = GGUF(path).reader.tensors
    layers = [t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    ends = [t.tensor_type.name for t in tensors if t.name in ("token_embd.weight", "output.weight")]
    exact = layers and all(k in INT4_EXACT for k in layers) and all(k == "Q8_0" for k in ends)
    return ("int4",) if exact else ()


def set_norm(norm: RMSNorm, weight: torch.Tensor) -> None:
    """A norm built on the meta device, given its weight and its buffers on the CPU."""
    norm.weight = nn.Parameter(weight, requires_grad=False)
    norm.reset_buffers()


def stored_fingerprint(f: GGUF, lm: Llama) -> str:
    """A fingerprint of the family, config, tokenizer and the file's tensors as stored."""
    h = hashlib.sha256()
    h.update(f"{lm.family} gguf-stored".encode())
    h.update(json.dumps(lm.config_dict(), sort_keys=True).encode())
    h.update(json.dumps(lm.tokenizer.spec() if lm.tokenizer else None, sort_keys=True).encode())
    for name in sorted(f.tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(f.tensors[name].data).tobytes())
    return h.hexdigest()[:16]


def tokenizer(f: GGUF) -> BPETokenizer:
    """The file's tokenizer, built with `tokenizers` (a byte-level BPE)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{f.path}: tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: pre-tokenizer {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")
    tokens = [_byte_level(t) for t in f.get("tokenizer.ggml.tokens")]
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False)
    )
    split, digits = PRE_TOKENIZERS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    types = f.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types, strict=False)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED
        ]
    )
    bos = f.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
    return BPETokenizer(
        tok.to_str(), len(tokens), bos if add_bos else None, f.get("tokenizer.ggml.eos_token_id")
    )


def _byte_level(token: str) -> str:
    """A token in the byte-level alphabet (GPT-2's bytes_to_unicode), as the merges spell it;
    a file that wrote one in plain text (a space, say) gets it respelled, as transformers does."""
    alphabet = _BYTE_ALPHABET
    if all(c in alphabet for c in token):
        return token
    return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's map of the 256 bytes to printable characters, indexed by byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS)


def chat_template(path: Path) -> ChatTemplate | None:
    """The file's chat template, stopping at the EOS token's text and the end-of-turn
    token's (if named), or None when it has none (`model.gguf_metadata`: read once)."""
    found = metadata(path).template
    return None if found is None else ChatTemplate(*found)


def read(path: Path, weights: str = "fp32") -> Llama:
    """The model in the GGUF file `path` (on CPU, eval mode): fp32 (every tensor
    dequantized), or with its weights packed (`weights` int4 or int8: `read_packed`)."""
    if weights in PACKED:
        return read_packed(path, weights)
    f = GGUF(path)
    cfg = native_config(f)
    lm = build("llama", cfg, tokenizer(f).spec(), weights=state_dict(f, cfg))
    assert isinstance(lm, Llama)
    return lm.eval()


READER = Reader(
    "gguf",
    "a GGUF file of a LLaMA model, or a directory holding one",
    is_gguf,
    read,
    template=chat_template,
    packs=PACKED,
    exact=exact_packs,
)
