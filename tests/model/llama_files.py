"""Tiny LLaMA-architecture checkpoints for tests, written the way their makers write them:
GGUF files with ggml's own `gguf` writer (llama.cpp's tensor names, its q/k row permutation,
each tensor type), and the `tokenizers` files of HF directories. The weights are random but
large enough that attention is sharp, so a wrong permutation or mask shows in the logits;
the tokenizer is a byte-level BPE trained here on Shakespeare, with ChatML's special tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from model.corpus import load_split

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the tiny models' shape (rows a multiple of ggml's block of 32 where the types need it)
CONFIG = dict(
    vocab_size=384, n_layer=2, d_model=64, n_head=4, n_kv_head=2, head_dim=16, d_ff=96, rope_base=10000.0
)
# a shape whose matrices K-quants hold: every row a multiple of their super-block of 256
K_CONFIG = dict(CONFIG, d_model=256, d_ff=512, head_dim=64)
TRAINED_CONTEXT = 512


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE of CONFIG's vocabulary size, trained on a held-out play, digits one by
    one (as SmolLM2's, the GGUF pre-tokenizer "smollm"); ids 0..2 are SPECIALS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = load_split("shakespeare", "valid")[0][1]
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, 200_000, 2000)], trainer)
    assert tok.get_vocab_size() == CONFIG["vocab_size"]
    return tok.to_str()


def byte_vocabulary() -> tuple[list[str], list[str]]:
    """SPECIALS, then the 256 bytes (as GPT-2's byte-level BPE writes them), and no merges:
    any text tokenizes to its bytes, so whatever a model writes tokenizes back to the
    same ids (a trained BPE's merges make a random model's output non-canonical)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shown, extra = {}, 0
    for b in range(256):
        if b in printable:
            shown[b] = chr(b)
        else:
            shown[b], extra = chr(256 + extra), extra + 1
    return [*SPECIALS, *(shown[b] for b in range(256))], []


def vocabulary() -> tuple[list[str], list[str]]:
    """The trained tokenizer's tokens in id order and its merges ("a b")."""
    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def random_weights(seed: int, cfg: dict = CONFIG, tied: bool = True) -> dict[str, torch.Tensor]:
    """HF-named LLaMA weights (model.layers.i.self_attn.q_proj.weight, ...), random; the
    layers' matrices scaled by 64 / d_model, so that a wider shape's logits (`K_CONFIG`)
    stay the size of `CONFIG`'s."""
    g = torch.Generator().manual_seed(seed)
    d, H, kvh, hd, ff = (cfg[k] for k in ("d_model", "n_head", "n_kv_head", "head_dim", "d_ff"))

    def rnd(*shape: int, std: float = 0.15) -> torch.Tensor:
        wide = 64 / d if len(shape) == 2 and shape[0] != cfg["vocab_size"] else 1.0
        return torch.randn(*shape, generator=g) * std * wide

    out = {
        "model.embed_tokens.weight": rnd(cfg["vocab_size"], d, std=1.0),
        "model.norm.weight": 1 + rnd(d, std=0.2),
    }
    if not tied:
        out["lm_head.weight"] = rnd(cfg["vocab_size"], d)
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": rnd(H * hd, d, std=0.3),
                p + "self_attn.k_proj.weight": rnd(kvh * hd, d, std=0.3),
                p + "self_attn.v_proj.weight": rnd(kvh * hd, d),
                p + "self_attn.o_proj.weight": rnd(d, H * hd),
                p + "mlp.gate_proj.weight": rnd(ff, d),
                p + "mlp.up_proj.weight": rnd(ff, d),
                p + "mlp.down_proj.weight": rnd(d, ff),
                p + "input_layernorm.weight": 1 + rnd(d, std=0.2),
                p + "post_attention_layernorm.weight": 1 + rnd(d, std=0.2),
            }
        )
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` of a q or k projection's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensors(weights: dict[str, torch.Tensor], cfg: dict = CONFIG) -> dict[str, np.ndarray]:
    """HF-named weights -> llama.cpp's names and layout (q and k rows permuted)."""
    out = {}
    for name, t in weights.items():
        a = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            if part == "self_attn.q_proj":
                a = permute(a, cfg["n_head"])
            elif part == "self_attn.k_proj":
                a = permute(a, cfg["n_kv_head"])
            out[f"blk.{i}.{GGUF_NAMES[part]}.weight"] = a
        else:
            key = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }
            out[key.get(name, "output.weight")] = a
    return out


def write_gguf(
    path: Path,
    weights: dict[str, torch.Tensor],
    qtype: str,
    pre: str = "smollm",
    cfg: dict = CONFIG,
    sampling: dict[str, float] | None = None,
    vocab: tuple[list[str], list[str]] | None = None,
    types: dict[str, str] | None = None,
) -> Path:
    """A LLaMA GGUF file with its matrices in `qtype` (norms stay F32, as llama.cpp keeps them),
    the BPE tokenizer and ChatML template in its metadata, and `sampling` as llama.cpp's
    `general.sampling.*` keys ({"temp": 0.3, "top_k": 20}: top_k an int, the rest floats);
    `vocab`, (tokens, merges) other than the trained tokenizer's (`byte_vocabulary`); `types`,
    another type for the matrices whose GGUF name holds a key ({"attn_v": "Q6_K"}: llama.cpp's
    Q4_K_M mixes types so)."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["n_layer"])
    w.add_context_length(TRAINED_CONTEXT)
    w.add_embedding_length(cfg["d_model"])
    w.add_feed_forward_length(cfg["d_ff"])
    w.add_head_count(cfg["n_head"])
    w.add_head_count_kv(cfg["n_kv_head"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(cfg["vocab_size"])
    tokens, merges = vocab or vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for key, value in (sampling or {}).items():
        add = w.add_int32 if key == "top_k" else w.add_float32
        add(f"general.sampling.{key}", value)
    for name, a in gguf_tensors(weights, cfg).items():
        kind = GGMLQuantizationType[next((t for k, t in (types or {}).items() if k in name), qtype)]
        if a.ndim == 1 or kind == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif kind == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif kind.name in PACKERS:
            w.add_tensor(name, PACKERS[kind.name](a), raw_dtype=kind)
        else:
            w.add_tensor(name, quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q4_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q4_K super-blocks (N, K/256 x 144 bytes), as ggml-quants.h's block_q4_K
    lays them out: d and dmin (f16), the 8 groups' 6-bit scales and mins packed in 12 bytes,
    then 128 bytes of nibbles (bytes 32p..32p+31: group 2p's low, 2p+1's high). Each group
    of 32 fit by its own min and max (w = d sc q - dmin m), not llama.cpp's search: a valid
    block near the weights is what a reader's test needs. (The `gguf` package reads K-quants
    but does not write them.)"""
    head, q = _six_bit_head(*_min_fit(_groups(a, 32), 15, 63))
    return np.concatenate([head, _nibbles(q)], -1).reshape(a.shape[0], -1)


def q5_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q5_K super-blocks (N, K/256 x 176 bytes), block_q5_K: Q4_K's head, then
    32 bytes of fifth bits (bit j of byte l: group j's element l), then the low nibbles as
    Q4_K lays them out."""
    head, q = _six_bit_head(*_min_fit(_groups(a, 32), 31, 63))
    return np.concatenate([head, _bits(q >> 4, 1), _nibbles(q & 15)], -1).reshape(a.shape[0], -1)


def q6_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q6_K super-blocks (N, K/256 x 210 bytes), as block_q6_K lays them out:
    the 6-bit codes' low nibbles (128 bytes) and high pairs (64), 16 int8 scales (one per 16
    weights), d (f16); w = d sc (q - 32). Each half of 128 weights: element l of its four
    quarters shares ql[l] (quarters 1, 3), ql[l + 32] (2, 4) and qh[l] (all four)."""
    N, K = a.shape
    g = _groups(a, 16)
    amax = np.abs(g).max(-1) / 31
    d = (amax.max(-1) / 127).astype(np.float16)
    sc = _levels(amax, d.astype(np.float32)[..., None], 127)
    step = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(g / np.where(step > 0, step, 1)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(N, K // 256, 2, 4, 32)  # (half, quarter, element)
    ql = np.concatenate(
        [q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4, q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], -1
    )
    parts = [
        ql.reshape(N, -1, 128),
        _bits(q >> 4, 2).reshape(N, -1, 64),
        sc.astype(np.int8).view(np.uint8),
        _half(d),
    ]
    return np.concatenate(parts, -1).reshape(N, -1)


def q2_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q2_K super-blocks (N, K/256 x 84 bytes), block_q2_K: 16 bytes of 4-bit
    scales (low nibble) and mins (high) for the 16 groups of 16, 64 bytes of 2-bit codes
    (`_quarters`), d and dmin (f16); w = d sc q - dmin m."""
    d, dmin, sc, m, q = _min_fit(_groups(a, 16), 3, 15)
    return np.concatenate([sc | m << 4, _quarters(q), _half(d), _half(dmin)], -1).reshape(a.shape[0], -1)


def q3_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q3_K super-blocks (N, K/256 x 110 bytes), block_q3_K: 32 bytes of the
    codes' high bits (bit i of byte l: element 32 i + l; set for a code >= 0), 64 bytes of
    their low 2 bits (`_quarters`, as Q2_K), the 16 groups' signed 6-bit scales (stored
    + 32: low nibbles in bytes 0-7, scale b and b + 8 sharing byte b; high pairs in bytes
    8-11, scale i's in byte i % 4 at bits 2 (i // 4)), d (f16); w = d s q, q in [-4, 3].
    Each group's scale takes its largest |w| to q = -4."""
    N = a.shape[0]
    g = _groups(a, 16)
    extreme = _extreme(g)
    d = (np.abs(extreme).max(-1) / 4 / 31).astype(np.float16)
    s = np.clip(np.round(-extreme / 4 / np.where(d > 0, d, 1).astype(np.float32)[..., None]), -32, 31)
    step = d.astype(np.float32)[..., None] * s
    q = np.clip(np.round(g / np.where(step != 0, step, 1)[..., None]), -4, 3).astype(np.int8)
    high = _bits((q >= 0).astype(np.uint8).reshape(N, -1, 8, 32), 1)
    stored = (s + 32).astype(np.uint8)  # (N, S, 16)
    nibbles = stored[..., :8] & 15 | (stored[..., 8:] & 15) << 4
    pairs = _bits((stored >> 4).reshape(N, -1, 4, 4), 2)
    parts = [high, _quarters((q & 3).astype(np.uint8)), nibbles, pairs, _half(d)]
    return np.concatenate(parts, -1).reshape(N, -1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def iq4_nl(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> IQ4_NL blocks (N, K/32 x 18 bytes), block_iq4_nl: d (f16), then 16 bytes
    of 4-bit indices into llama.cpp's non-uniform table (`IQ4_VALUES`); w = d value. Each
    block's scale takes its largest |w| to -127, the table's widest end."""
    N, K = a.shape
    g = a.reshape(N, K // 32, 32).astype(np.float32)
    d = (_extreme(g) / -127).astype(np.float16)
    return np.concatenate([_half(d), _iq4_codes(g, d.astype(np.float32))], -1).reshape(N, -1)


def iq4_xs(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> IQ4_XS super-blocks (N, K/256 x 136 bytes), block_iq4_xs: d (f16), the
    8 groups' 6-bit scales (stored + 32: high pairs in a uint16, group i's at bits 2i; low
    nibbles in 4 bytes, groups 2b and 2b + 1 sharing byte b), then each group of 32's indices
    as IQ4_NL lays them; w = d (ls - 32) value."""
    N = a.shape[0]
    g = _groups(a, 32)
    extreme = _extreme(g) / -127
    d = (np.abs(extreme).max(-1) / 31).astype(np.float16)
    ls = np.clip(np.round(extreme / np.where(d > 0, d, 1).astype(np.float32)[..., None]), -32, 31) + 32
    stored = ls.astype(np.uint16)
    high = _bits((stored >> 4)[..., None], 2)[..., 0]  # (N, S): a uint16
    low = (stored[..., 0::2] & 15 | (stored[..., 1::2] & 15) << 4).astype(np.uint8)  # (N, S, 4)
    codes = _iq4_codes(g, d.astype(np.float32)[..., None] * (ls - 32)).reshape(N, -1, 128)
    return np.concatenate([_half(d), high[..., None].view(np.uint8), low, codes], -1).reshape(N, -1)


# -- the packers' shared parts --------------------------------------------------------------
def _groups(a: np.ndarray, size: int) -> np.ndarray:
    """(N, K) -> (N, K/256 super-blocks, 256/size groups, size) fp32."""
    N, K = a.shape
    return a.reshape(N, K // 256, 256 // size, size).astype(np.float32)


def _min_fit(g: np.ndarray, top: int, scale_top: int) -> tuple[np.ndarray, ...]:
    """Groups (N, S, G, size) fit by their min and max (w = d sc q - dmin m, the range holding
    0): d and dmin (N, S) f16, each group's sc and m (N, S, G) in [0, scale_top] and its
    codes q (N, S, G, size) in [0, top]."""
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    d, dmin = ((x.max(-1) / scale_top).astype(np.float16) for x in ((hi - lo) / top, -lo))
    sc, m = (
        _levels(x, y.astype(np.float32)[..., None], scale_top) for x, y in (((hi - lo) / top, d), (-lo, dmin))
    )
    step, low = d.astype(np.float32)[..., None] * sc, dmin.astype(np.float32)[..., None] * m
    return d, dmin, sc, m, _levels(g + low[..., None], step[..., None], top)


def _six_bit_head(d, dmin, sc, m, q) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's super-block head (d, dmin, the 8 groups' 6-bit scales and mins in 12
    bytes) (N, S, 16), and the codes passed through."""
    scales = np.concatenate(
        [sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6, (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4],
        -1,
    )  # fmt: skip
    return np.concatenate([_half(d), _half(dmin), scales], -1), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes (N, S, 8 groups, 32) in [0, 15] -> 128 bytes a super-block: 32 bytes to each
    pair of groups, the first's in the low nibbles."""
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)
    return (pairs[..., 0, :] | pairs[..., 1, :] << 4).reshape(*q.shape[:2], 128)


def _quarters(q: np.ndarray) -> np.ndarray:
    """2-bit codes (N, S, ..., 256 in all) -> 64 bytes a super-block: each half of 128 takes
    32 bytes, element l of its quarter j at bits 2j of byte l (Q2_K's and Q3_K's layout)."""
    return _bits(q.reshape(*q.shape[:2], 2, 4, 32), 2).reshape(*q.shape[:2], 64)


def _bits(x: np.ndarray, width: int) -> np.ndarray:
    """Fields (..., n, L) of `width` bits -> (..., L) of x's dtype: field i at bits width i."""
    shifts = (width * np.arange(x.shape[-2], dtype=x.dtype))[:, None]
    return (x << shifts).sum(-2, dtype=x.dtype)


def _extreme(g: np.ndarray) -> np.ndarray:
    """Each group's weight of the largest |w|, its sign kept: (..., size) -> (...)."""
    return np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]


def _iq4_codes(g: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest of IQ4_VALUES to each w / step, as an index, in the blocks' nibble order:
    groups of 32 -> 16 bytes, elements 0-15 in the low nibbles and 16-31 in the high."""
    x = g / np.where(step != 0, step, 1)[..., None]
    idx = np.abs(x[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    return idx[..., :16] | idx[..., 16:] << 4


def _half(x: np.ndarray) -> np.ndarray:
    """f16 values (...) -> their bytes (..., 2)."""
    return x[..., None].view(np.uint8)


def _levels(x: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round(x / step) in [0, top] as uint8 (0 where the step is 0)."""
    return np.clip(np.round(x / np.where(step > 0, step, 1)), 0, top).astype(np.uint8)


# the types `gguf` reads but does not write, packed here
PACKERS = {
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
}


def write_hf_tokenizer(directory: Path, bos_in_text: bool = False) -> None:
    """tokenizer.json and tokenizer_config.json (ChatML, BOS <|im_start|>, EOS <|im_end|>) of
    a HF directory; `bos_in_text`: encoding with special tokens prepends BOS (LLaMA's way)."""
    spec = json.loads(tokenizer_json())
    if bos_in_text:
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {
                "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
            },
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
