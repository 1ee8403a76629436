"""HF checkpoints of the hybrids, read into `gdn-hybrid` (`model/gdn_hybrid.py`) and
`mamba2-hybrid` (`model/mamba2_hybrid.py`). A source directory holds

    config.json         model_type "qwen3_5" (its text_config; the vision tower is left out),
                        "qwen3_5_text", "qwen3_next", "granitemoehybrid" or "bamba";
                        `layer_types` (Bamba: `attn_layer_indices`) is the layer pattern
    model.safetensors   or its shards (model.safetensors.index.json)
    tokenizer.json      when present, used as it is (else the byte tokenizer where it fits)

The weights are renames plus a few joins: gate and up into one matrix; Qwen3.5's b and a
projections into one; Qwen3-Next's q/k/v/z and b/a projections, which it groups by key head,
reordered into Qwen3.5's layout; Qwen's zero-centred RMSNorm weights w stored as 1 + w (the
gated norm inside each DeltaNet layer is plain already). Refused with a clear error:
mixture-of-experts MLPs (Qwen3-Next's `num_experts`, Granite's `num_local_experts`, or a
`qwen3_5_moe` model), RoPE scaling, another activation than silu, weights that do not fit.

Converted models serve with exact attention up to `DEFAULT_CONTEXT` tokens (or the model's
own trained context, when shorter); `attention=bounded` and its sinks and window are serving
options. Only safetensors are read: nothing here unpickles. This module must never import
`model/checkpoint.py`, which picks this reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .attention import Pair
from .family import LanguageModel
from .hf_files import read_weights, stop_strings, tokenizer, tokenizer_spec
from .native import build, families, fingerprint
from .reader import TGT_LEN, Reader, config_json

GDN = ("qwen3_5", "qwen3_5_text", "qwen3_next")
MAMBA2 = ("granitemoehybrid", "bamba")
DEFAULT_CONTEXT = 32768  # the exact attention's bound a converted model gets by default
RECURRENT, ATTENTION = ("linear_attention", "mamba"), ("full_attention", "attention")


def claims(path: Path) -> bool:
    """Whether `path` is a directory whose config.json this reader converts."""
    return config_json(path).get("model_type") in (*GDN, *MAMBA2, "qwen3_5_moe")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: Qwen3.5's text_config (with the top level's token ids
    and tying where it has none of its own), else the config itself."""
    if hf.get("model_type") == "qwen3_5_moe":
        raise ValueError(
            "qwen3_5_moe is a mixture-of-experts model: its MLPs are not supported yet (dense only)"
        )
    if hf.get("model_type") != "qwen3_5":
        return hf
    inherited = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf}
    return {**inherited, **hf["text_config"], "model_type": "qwen3_5_text"}


def _pattern(hf: dict[str, Any]) -> str:
    types = hf.get("layer_types") or hf.get("layers_block_type")
    if types is None and hf["model_type"] == "bamba":  # Bamba names its attention layers
        attention = set(hf.get("attn_layer_indices") or [])
        types = ["attention" if i in attention else "mamba" for i in range(hf["num_hidden_layers"])]
    if types is None and hf["model_type"] in GDN:  # the old configs' rule
        every = hf.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    if not types or any(t not in (*RECURRENT, *ATTENTION) for t in types):
        raise ValueError(f"layer_types {types!r}: each must be one of {', '.join((*RECURRENT, *ATTENTION))}")
    return "".join("r" if t in RECURRENT else "a" for t in types)


def _rope(hf: dict[str, Any], head_dim: int) -> tuple[int, float]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported (plain RoPE only)"
        )
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor), float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def native_config(hf: dict[str, Any], **overrides: Any) -> tuple[str, dict[str, Any]]:
    """A HF config dict (the language model's) -> (the native family, its config fields)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    d, n_head = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n_head
    cfg: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "d_model": d,
        "pattern": _pattern(hf),
        "n_head": n_head,
        "n_kv_head": hf.get("num_key_value_heads") or n_head,
        "head_dim": head_dim,
        "attn_bias": bool(hf.get("attention_bias", False)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_weights": bool(hf.get("tie_word_embeddings", False)),
        "max_context": min(hf.get("max_position_embeddings") or DEFAULT_CONTEXT, DEFAULT_CONTEXT),
    }
    cfg["rope_dim"], cfg["rope_base"] = _rope(hf, head_dim)
    family = "gdn-hybrid" if hf["model_type"] in GDN else "mamba2-hybrid"
    cfg.update(_gdn(hf) if family == "gdn-hybrid" else _granite(hf, cfg["rope_dim"]))
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return family, cfg


def _gdn(hf: dict[str, Any]) -> dict[str, Any]:
    dense = set(hf.get("mlp_only_layers") or [])
    if hf.get("num_experts", 0) > 0 and len(dense) < hf["num_hidden_layers"]:
        raise ValueError(
            "this Qwen3-Next has mixture-of-experts MLPs (num_experts > 0): not supported yet (dense only)"
        )
    return {
        "d_ff": hf["intermediate_size"],
        "d_conv": hf.get("linear_conv_kernel_dim", 4),
        "n_k_heads": hf["linear_num_key_heads"],
        "n_v_heads": hf["linear_num_value_heads"],
        "k_head_dim": hf["linear_key_head_dim"],
        "v_head_dim": hf["linear_value_head_dim"],
        "attn_gate": True,
        "qk_norm": True,
    }


def _granite(hf: dict[str, Any], rope_dim: int) -> dict[str, Any]:
    """Granite-4.0-H's Mamba-2 layers, MLP and multipliers; or Bamba's, the same layers with a
    plain MLP, RoPE always (on half of each head) and no multipliers."""
    if hf.get("mlp_bias"):
        raise ValueError("MLP biases are not supported")
    bamba = hf["model_type"] == "bamba"
    if hf.get("num_local_experts", 0) > 0:
        raise ValueError(
            "this Granite has mixture-of-experts MLPs (num_local_experts > 0): not supported yet (dense only)"
        )
    d, expand, heads = hf["hidden_size"], hf.get("mamba_expand", 2), hf.get("mamba_n_heads", 128)
    head = hf.get("mamba_d_head", "auto")
    head = expand * d // heads if head == "auto" else head
    if heads * head != expand * d:
        raise ValueError("mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    lo, hi = hf.get("time_step_limit") or (0.0, None)
    hi = hi["__float__"] if isinstance(hi, dict) else hi
    return {
        "d_ff": hf["intermediate_size" if bamba else "shared_intermediate_size"],
        "rope_dim": rope_dim if bamba or hf.get("position_embedding_type") == "rope" else 0,
        "attn_scale": 0.0 if bamba else float(hf.get("attention_multiplier", 1.0)),
        "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
        "d_conv": hf.get("mamba_d_conv", 4),
        "d_state": hf.get("mamba_d_state", 256),
        "expand": expand,
        "ssm_head_dim": head,
        "n_groups": hf.get("mamba_n_groups", 1),
        "chunk_size": hf.get("mamba_chunk_size", 256),
        "dt_limit": (float(lo), None if hi is None or float(hi) == float("inf") else float(hi)),
        "conv_bias": bool(hf.get("mamba_conv_bias", True)),
        "ssm_bias": bool(hf.get("mamba_proj_bias", False)),
    }


# -- weights --------------------------------------------------------------------------------
def _qwen3_next_split(qkvz: torch.Tensor, ba: torch.Tensor, cfg: dict[str, Any]) -> tuple[Pair, Pair]:
    """Qwen3-Next's projections, grouped by key head ([q k v z] and [b a] per head) ->
    Qwen3.5's layout: ([q; k; v], z) and ([b; a] as `in_proj_ba` takes it)."""
    Hk, dk, dv = cfg["n_k_heads"], cfg["k_head_dim"], cfg["v_head_dim"]
    r = cfg["n_v_heads"] // Hk
    if qkvz.shape[0] != Hk * (2 * dk + 2 * r * dv) or ba.shape[0] != 2 * r * Hk:
        raise ValueError(
            f"in_proj_qkvz / in_proj_ba have shapes {list(qkvz.shape)} / {list(ba.shape)}, which the config's "
            "linear attention heads do not imply"
        )
    q, k, v, z = qkvz.view(Hk, -1, qkvz.shape[-1]).split([dk, dk, r * dv, r * dv], 1)
    b, a = ba.view(Hk, 2 * r, -1).split([r, r], 1)
    flat = [t.flatten(0, 1) for t in (q, k, v, z, b, a)]
    return (torch.cat(flat[:3]), flat[3]), (flat[4], flat[5])


def _renamed(name: str, family: str) -> str:
    """A HF layer weight's name (without model.layers.i.) -> the native one."""
    for old, new in (
        ("input_layernorm.", "norm1."),
        ("post_attention_layernorm.", "norm2."),
        ("self_attn.", "mixer."),
        ("linear_attn.", "mixer."),
        ("mamba.", "mixer."),
        ("pre_ff_layernorm.", "norm2."),
        ("mlp.down_proj.", "mlp.down."),
        ("feed_forward.down_proj.", "mlp.down."),
        ("shared_mlp.output_linear.", "mlp.down."),
        ("shared_mlp.input_linear.", "mlp.gate_up."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def state_dict(source: dict[str, torch.Tensor], family: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The family's weights from HF's names."""
    src = {}
    for k, v in source.items():
        if k.startswith(("mtp.", "model.visual.")) or k.endswith("rotary_emb.inv_freq"):
            continue  # the multi-token prediction head, the vision tower, a recomputed buffer
        src[k.removeprefix("model.language_model.").removeprefix("model.")] = v.to(torch.float32)
    zero_centred = family == "gdn-hybrid"  # Qwen's norms: weight 1 + w
    out = {
        "embed.weight": src.pop("embed_tokens.weight"),
        "norm_out.weight": src.pop(
            "final_layernorm.weight" if "final_layernorm.weight" in src else "norm.weight"
        )
        + zero_centred,
    }
    head = src.pop("lm_head.weight", None)
    if not cfg["tie_weights"]:
        if head is None:
            raise ValueError("the weights have no lm_head.weight and the config does not tie it")
        out["head.weight"] = head
    for i in range(len(cfg["pattern"])):
        p = f"layers.{i}."
        mine = {k[len(p) :]: src.pop(k) for k in [k for k in src if k.startswith(p)]}
        out.update({p + k: v for k, v in _layer(mine, family, cfg, zero_centred).items()})
    if src:
        raise ValueError(f"unexpected weights: {sorted(src)[:8]}")
    return out


def _layer(
    w: dict[str, torch.Tensor], family: str, cfg: dict[str, Any], zero_centred: bool
) -> dict[str, torch.Tensor]:
    for mlp in ("mlp", "feed_forward"):  # Qwen's, Bamba's
        if f"{mlp}.gate_proj.weight" in w:
            w["mlp.gate_up.weight"] = torch.cat(
                [w.pop(f"{mlp}.gate_proj.weight"), w.pop(f"{mlp}.up_proj.weight")]
            )
    if "linear_attn.in_proj_qkvz.weight" in w:
        (qkv, z), (b, a) = _qwen3_next_split(
            w.pop("linear_attn.in_proj_qkvz.weight"), w.pop("linear_attn.in_proj_ba.weight"), cfg
        )
        w.update({"linear_attn.in_proj_qkv.weight": qkv, "linear_attn.in_proj_z.weight": z})
        w["linear_attn.in_proj_b.weight"], w["linear_attn.in_proj_a.weight"] = b, a
    if "linear_attn.in_proj_b.weight" in w:
        w["linear_attn.in_proj_ba.weight"] = torch.cat(
            [w.pop("linear_attn.in_proj_b.weight"), w.pop("linear_attn.in_proj_a.weight")]
        )
    out = {_renamed(k, family): v for k, v in w.items()}
    if zero_centred:
        for k in ("norm1.weight", "norm2.weight", "mixer.q_norm.weight", "mixer.k_norm.weight"):
            if k in out:
                out[k] = out[k] + 1.0
    return out


def read(path: str | Path, **overrides: Any) -> LanguageModel:
    """The native model for a HF hybrid directory (on CPU, fp32, eval mode); `overrides`
    replace native config fields (e.g. tgt_len, the serving chunk)."""
    path = Path(path)
    hf = text_config(json.loads((path / "config.json").read_text()))
    family, cfg = native_config(hf, **overrides)
    spec = tokenizer(path, hf).spec() if (path / "tokenizer.json").is_file() else tokenizer_spec(path, hf)
    weights = state_dict(read_weights(path), family, cfg)
    if cfg["tie_weights"]:
        weights["head.weight"] = weights["embed.weight"]
    _check_fits(weights, family, cfg)
    lm = build(family, cfg, spec, weights=weights)
    lm.fingerprint = fingerprint(lm)
    return lm.eval()


def _check_fits(weights: dict[str, torch.Tensor], family: str, cfg: dict[str, Any]) -> None:
    """Raise ValueError unless `weights` are exactly the names and shapes the config implies."""
    cls = families()[family]
    with torch.device("meta"):
        want = {k: v.shape for k, v in cls(cls.config_class(**cfg)).state_dict().items()}
    missing, unexpected = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, shape in want.items():
        if weights[name].shape != shape:
            raise ValueError(
                f"weight {name} has shape {list(weights[name].shape)}, the config implies {list(shape)}"
            )


READER = Reader(
    "hf-hybrid",
    "a HF Qwen3.5, Qwen3-Next, Granite-4.0-H or Bamba directory (config.json, model.safetensors)",
    claims,
    read,
    flags=(TGT_LEN,),
    turn_stops=stop_strings,
)
