"""Parity with HF transformers (a current release, `.venv-ref-current/`) on tiny LLaMA
checkpoints in every layout the family reads: GGUF files in each tensor type (written with
ggml's `gguf` writer, q and k rows permuted as llama.cpp permutes them; the K-quants' blocks
packed by tests/model/llama_files.py, which `gguf` reads but does not write), a HF LLaMA
directory with a separate head and a BOS, and a HF Mistral directory whose sliding window
the text overruns. One reference subprocess (tests/model/llama_reference.py) makes every
reference; recur loads the same files and must agree on every log-prob over a few hundred
tokens of held-out Shakespeare (1e-3), and on the token ids of three texts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from app.cli import main as recur_cli
from model import llama_gguf
from model.corpus import load_split

from .llama_files import CONFIG, K_CONFIG, TRAINED_CONTEXT, random_weights, write_gguf, write_hf_tokenizer
from .reference_env import CURRENT

REF_SCRIPT = Path(__file__).with_name("llama_reference.py")
TOL = 1e-3
N_TOKENS = 300
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
# K-quant files (K_CONFIG's shape: rows of whole super-blocks): Q4_K and Q5_K alone, and mixes as
# llama.cpp's recipes make them (Q4_K_M: attn_v, ffn_down and the embedding in Q6_K; Q3_K_M:
# attn_v Q5_K, ffn_down Q4_K; Q2_K: attn_v and ffn_down Q3_K; IQ4_XS with some IQ4_NL):
# name -> (type, others)
K_FILES = {
    "Q4_K": ("Q4_K", {}),
    "Q5_K": ("Q5_K", {}),
    "Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
    "Q3_K_M": ("Q3_K", {"attn_v": "Q5_K", "ffn_down": "Q4_K", "token_embd": "Q6_K"}),
    "Q2_K": ("Q2_K", {"attn_v": "Q3_K", "ffn_down": "Q3_K", "token_embd": "Q6_K"}),
    "IQ4_XS": ("IQ4_XS", {"attn_v": "IQ4_NL", "token_embd": "Q6_K"}),
}
TEXTS = [
    load_split("shakespeare", "test")[0][1][5000:6500],
    "Ça va? Größe, 東京タワー, Москва — naïve café; ≠ ∞. 🙂 Ελληνικά, עברית, العربية, हिन्दी, 한국어.",
    "def f(x: int) -> int:\n    return x ** 2 + 1024  # 3.14\n\nprint([f(i) for i in range(10)])\n",
]
HF_CONFIG = dict(
    vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["d_model"], intermediate_size=CONFIG["d_ff"],
    num_hidden_layers=CONFIG["n_layer"], num_attention_heads=CONFIG["n_head"], num_key_value_heads=CONFIG["n_kv_head"],
    head_dim=CONFIG["head_dim"], max_position_embeddings=TRAINED_CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
    initializer_range=0.15, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
HF_CASES = {
    "hf-llama": dict(model_type="llama", tie_word_embeddings=False),
    "hf-mistral": dict(
        model_type="mistral", tie_word_embeddings=True, sliding_window=16
    ),  # 300 tokens: beyond it
}


def held_out_ids(lm: model.LanguageModel) -> list[int]:
    text = load_split("shakespeare", "test")[1][1]
    assert lm.tokenizer is not None
    return lm.tokenizer.encode(text[20_000:40_000])[:N_TOKENS]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> the checkpoint recur reads (a GGUF file or a HF directory), with the reference's
    results beside it in the module's OUT directory."""
    root = tmp_path_factory.mktemp("llama-parity")
    out = root / "out"
    out.mkdir()
    paths: dict[str, Path] = {}
    for i, qtype in enumerate(TYPES):
        paths[qtype] = write_gguf(root / f"tiny-{qtype}.gguf", random_weights(seed=i), qtype)
    for i, (name, (qtype, types)) in enumerate(K_FILES.items()):
        weights = random_weights(seed=30 + i, cfg=K_CONFIG)
        paths[name] = write_gguf(root / f"tiny-{name}.gguf", weights, qtype, cfg=K_CONFIG, types=types)
    paths["pre-llama-bpe"] = write_gguf(
        root / "tiny-llama-bpe.gguf", random_weights(seed=9), "F32", pre="llama-bpe"
    )
    for name in HF_CASES:
        paths[name] = root / name
        write_hf_tokenizer(paths[name], bos_in_text=name == "hf-llama")
    ids = held_out_ids(llama_gguf.read(paths["F32"]))
    spec = [
        {"name": name, "kind": "gguf", "dir": str(p.parent), "file": p.name, "ids": ids, "texts": TEXTS}
        for name, p in paths.items()
        if p.suffix == ".gguf"
    ]
    spec += [
        {"name": name, "kind": "hf", "dir": str(paths[name]), "config": {**HF_CONFIG, **over}, "seed": 20 + i, "ids": ids, "texts": TEXTS}
        for i, (name, over) in enumerate(HF_CASES.items())
    ]  # fmt: skip
    (out / "cases.json").write_text(json.dumps(spec))
    CURRENT.run(REF_SCRIPT, out, out / "cases.json", home=root / "hf-home", timeout=600)
    return paths


def reference(cases: dict[str, Path], name: str) -> tuple[torch.Tensor, list[list[int]]]:
    out = next(iter(cases.values())).parent / "out"
    return load_file(str(out / f"{name}.safetensors"))["logprobs"], json.loads(
        (out / f"{name}.json").read_text()
    )["tokens"]


def recur_logprobs(lm: model.LanguageModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of recur's logits over `ids`, fed in uneven chunks (N, V)."""
    state, parts, i = lm.new_state(1), [], 0
    with torch.no_grad():
        for n in (1, 37, 100, 5, N_TOKENS):
            logits, state = lm(torch.tensor([ids[i : i + n]]), state)
            parts.append(logits[0])
            i += n
    return torch.log_softmax(torch.cat(parts), -1)


@pytest.mark.parametrize("name", [*TYPES, *K_FILES, "pre-llama-bpe", *HF_CASES])
def test_logprobs_and_tokens_equal_transformers(cases, name):
    lm = model.load(cases[name], device="cpu", precision="fp32")
    ref, ref_tokens = reference(cases, name)
    ids = held_out_ids(lm)
    assert len(ids) == N_TOKENS
    got = recur_logprobs(lm, ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL
    assert [lm.tokenizer.encode(t) for t in TEXTS] == ref_tokens


def test_the_window_and_sinks_are_what_each_checkpoint_was_trained_with(cases):
    """A file without a window gets the default sinks and window within its trained context;
    Mistral keeps its sliding window (itself and 15 before it) and no sinks."""
    gguf = model.load(cases["F32"], device="cpu")
    assert (gguf.config.sinks, gguf.config.window, gguf.config.trained_context) == (
        4,
        TRAINED_CONTEXT - 5,
        TRAINED_CONTEXT,
    )
    mistral = model.load(cases["hf-mistral"], device="cpu")
    assert (mistral.config.sinks, mistral.config.window) == (0, 15)
    llama = model.load(cases["hf-llama"], device="cpu")
    assert (
        llama.tokenizer.bos_id == 1 and gguf.tokenizer.bos_id is None
    )  # as each encodes with special tokens
    assert not llama.config.tie_weights and mistral.config.tie_weights


def test_the_q_and_k_permutation_matters(cases, monkeypatch):
    """Reading the file without undoing llama.cpp's row permutation gives other log-probs:
    the parity above is what proves `unpermute`."""
    ref, _ = reference(cases, "F32")
    monkeypatch.setattr(llama_gguf, "unpermute", lambda w, n_head: w)
    lm = model.load(cases["F32"], device="cpu")
    assert (recur_logprobs(lm, held_out_ids(lm)) - ref).abs().max().item() > 100 * TOL


def test_chat_template_and_stops_come_from_the_checkpoint(cases):
    for name in ("Q8_0", "hf-llama"):
        template = model.checkpoint.chat_template(cases[name])
        assert template is not None and template.stop == ("<|im_end|>",)
        text = template.render([{"role": "user", "content": "hi"}])
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K_M", "hf-mistral"])
def test_convert_writes_a_native_checkpoint_that_loads_the_same(cases, tmp_path, capsys, name):
    dst = tmp_path / name
    assert recur_cli(["convert", str(cases[name]), str(dst)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["family"] == "llama" and (dst / "config.json").is_file()
    a, b = model.load(cases[name], device="cpu"), model.load(dst, device="cpu")
    assert a.fingerprint == b.fingerprint == printed["fingerprint"]
    assert model.checkpoint.chat_template(dst) == model.checkpoint.chat_template(cases[name])
    ids = held_out_ids(a)[:50]
    assert torch.equal(recur_logprobs(a, ids + ids * 6), recur_logprobs(b, ids + ids * 6))


def test_a_shipped_name_that_is_not_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(model.checkpoint.PACKAGED, "nowhere", ("no-such-distribution", "x.gguf"))
    with pytest.raises(FileNotFoundError, match="make install"):
        model.load("nowhere")
