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
    """HF-named LLaMA weights (model.layers.i.self_attn.q_proj.weight, ...), random."""
    g = torch.Generator().manual_seed(seed)
    d, H, kvh, hd, ff = (cfg[k] for k in ("d_model", "n_head", "n_kv_head", "head_dim", "d_ff"))

    def rnd(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

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
) -> Path:
    """A LLaMA GGUF file with its matrices in `qtype` (norms stay F32, as llama.cpp keeps them),
    the BPE tokenizer and ChatML template in its metadata, and `sampling` as llama.cpp's
    `general.sampling.*` keys ({"temp": 0.3, "top_k": 20}: top_k an int, the rest floats);
    `vocab`, (tokens, merges) other than the trained tokenizer's (`byte_vocabulary`)."""
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
    kind = GGMLQuantizationType[qtype]
    for name, a in gguf_tensors(weights, cfg).items():
        if a.ndim == 1 or kind == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif kind == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
