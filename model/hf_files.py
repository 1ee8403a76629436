"""What a Hugging Face checkpoint directory holds, read one way for every HF reader
(`hf.py`, `hf_ssm.py`, `hf_hybrid.py`, `llama_hf.py`):

    config.json, tokenizer_config.json, generation_config.json    JSON objects (`json_file`)
    model.safetensors            or the shards its *.index.json lists (`read_weights`);
    pytorch_model.bin            the same, as plain tensors, for a reader that allows it
    tokenizer.json               the `tokenizers` library's description, used as it is

A reader keeps what is its own (its config's fields, its weights' names); these files are
the same whichever family they hold, so no reader serves as another's library. `.bin` files
are read only with `torch.load(weights_only=True)`, which refuses anything but tensors and
plain containers: nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .tokenizer import BPETokenizer, ByteTokenizer

TOKENIZER_FILE = "tokenizer.json"


def json_file(file: Path) -> dict:
    """A JSON object from `file`, or {} where there is no such file or it holds no object."""
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


# -- weights ------------------------------------------------------------------------------------
def read_weights(path: Path, allow_bin: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's weights: model.safetensors or its shards, else (where
    `allow_bin`) pytorch_model.bin or its shards, as plain tensors only."""
    loaders: list[tuple[str, Callable[[Path], dict[str, torch.Tensor]]]] = [("model.safetensors", _safetensors)]
    if allow_bin:
        loaders.append(("pytorch_model.bin", _plain_tensors))
    for name, loader in loaders:
        index = path / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [shard for shard in shards if not (path / shard).is_file()]
            if missing:
                raise FileNotFoundError(f"{path}: {index.name} lists {missing[0]}, which is not there")
            return {k: v for shard in shards for k, v in loader(path / shard).items()}
        if (path / name).is_file():
            return loader(path / name)
    names = " or ".join(name for name, _ in loaders)
    only = "" if allow_bin else " (only safetensors are read)"
    raise FileNotFoundError(f"{path} has config.json but no {names}{only}")


def _safetensors(file: Path) -> dict[str, torch.Tensor]:
    return load_file(str(file), device="cpu")


def _plain_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # the safe unpickler refuses anything but tensors and containers
        raise ValueError(f"{file}: not a plain tensor state dict ({e}); refusing to unpickle it") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{file}: expected a state dict of tensors")
    return sd


# -- the tokenizer --------------------------------------------------------------------------------
def tokenizer(path: Path, hf: dict[str, Any]) -> BPETokenizer:
    """tokenizer.json as it is, with the BOS a stream starts with (when encoding with special
    tokens prepends it) and the EOS (tokenizer_config.json's, else config.json's)."""
    from tokenizers import Tokenizer as HFTokenizer

    file = path / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}")
    text = file.read_text(encoding="utf-8")
    tok = HFTokenizer.from_str(text)
    config = json_file(path / "tokenizer_config.json")
    bos, eos = (_token_id(tok, config.get(k), hf.get(k + "_id")) for k in ("bos_token", "eos_token"))
    plain, special = (
        tok.encode("a", add_special_tokens=False).ids,
        tok.encode("a", add_special_tokens=True).ids,
    )
    adds_bos = bos is not None and special[:1] == [bos] and special[1:] == plain
    return BPETokenizer(text, hf["vocab_size"], bos if adds_bos else None, eos)


def _token_id(tok: Any, token: Any, fallback: Any) -> int | None:
    """A special token's id: by its text (a string, or HF's {"content": ...}), else `fallback`."""
    if isinstance(token, dict):
        token = token.get("content")
    found = tok.token_to_id(token) if isinstance(token, str) else None
    if found is None and isinstance(fallback, list):
        fallback = fallback[0] if fallback else None
    return found if found is not None else fallback


def tokenizer_spec(path: Path, hf: dict[str, Any]) -> dict:
    """The native tokenizer spec: tokenizer.json's, else the byte tokenizer's where it fits."""
    vocab = hf["vocab_size"]
    if not (path / TOKENIZER_FILE).is_file():
        if vocab < ByteTokenizer().vocab_size:
            raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}, and the vocabulary ({vocab}) cannot hold bytes")
        return {"kind": "byte"}

    def first(x: Any) -> int | None:
        return x[0] if isinstance(x, list) and x else x if isinstance(x, int) else None

    return {
        "kind": "bpe",
        "tokenizer": json.loads((path / TOKENIZER_FILE).read_text(encoding="utf-8")),
        "vocab_size": vocab,
        "bos_id": first(hf.get("bos_token_id")),
        "eos_id": first(hf.get("eos_token_id")),
    }


def stop_strings(path: Path) -> list[str]:
    """The texts of the tokens that end a turn: generation_config.json's EOS ids (one or a
    list), else config.json's."""
    from tokenizers import Tokenizer as HFTokenizer

    ids = json_file(path / "generation_config.json").get(
        "eos_token_id", json_file(path / "config.json").get("eos_token_id")
    )
    ids = ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
    if not ids or not (path / TOKENIZER_FILE).is_file():
        return []
    tok = HFTokenizer.from_file(str(path / TOKENIZER_FILE))
    return [t for t in (tok.decode([i], skip_special_tokens=False) for i in ids) if t]
