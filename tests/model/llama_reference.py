"""Reference log-probs and token ids from HF transformers (a current release, with gguf), for
tests/model/test_llama_parity.py and the shipped model's by-hand check (docs/MODEL_CARD.md).

Runs in a subprocess with `.venv-ref-current/` first on the path (tests/model/reference_env.py).
Usage: python llama_reference.py OUT CASES_JSON, where CASES_JSON lists cases:

  {"name", "kind": "gguf", "dir", "file", "ids": [...], "texts": [...]}
      AutoModelForCausalLM / AutoTokenizer .from_pretrained(dir, gguf_file=file), fp32
  {"name", "kind": "hf", "dir", "config": {...}, "seed", "ids": [...], "texts": [...]}
      a random LlamaForCausalLM / MistralForCausalLM (config["model_type"]) written to dir
      with save_pretrained (safetensors) beside the tokenizer files the test wrote there

A case with "streaming": {"sinks": S, "window": W} reads `ids` as a stream with S attention
sinks and a sliding window of W positions sees them (`streaming_logits`); any other, in one
pass over the whole of `ids`.

For each case it writes OUT/<name>.safetensors (`logprobs`: log_softmax of the logits over
`ids`, [N, V], or with "targets_only" just the log-prob of each next id, [N-1];
none with "tokenizer_only") and OUT/<name>.json ({"tokens": the ids of each text, no
special tokens added; with "smollm_split" also "tokens_smollm": the same tokenizer with
llama.cpp's "smollm" pre-tokenizer, each numeric character apart, which transformers' GGUF
reader leaves out}).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, MistralConfig


def load(case: dict) -> tuple[torch.nn.Module | None, object]:
    directory = Path(case["dir"])
    if case["kind"] == "gguf":
        kw = {"gguf_file": case["file"]}
        tok = AutoTokenizer.from_pretrained(directory, **kw)
        if case.get("tokenizer_only"):
            return None, tok
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kw), tok
    cls = MistralConfig if case["config"]["model_type"] == "mistral" else LlamaConfig
    config = cls(**{k: v for k, v in case["config"].items() if k != "model_type"})
    torch.manual_seed(case["seed"])
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that their weights matter
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    lm.save_pretrained(directory, safe_serialization=True)
    return lm, AutoTokenizer.from_pretrained(directory)


def streaming_logits(lm: torch.nn.Module, ids: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """The logits over `ids` (1, N) -> (N, V) as StreamingLLM serves them (Xiao et al., 2024),
    the semantics model/llama.py documents, with every number computed by transformers' own
    model and cache; this function only chooses which keys a query meets, and the positions
    transformers rotates them at:

      * the first S + W + 1 positions see every position before them: one ordinary forward;
      * after that, the query at p meets the S sinks and the W positions before it. The
        window's keys and values are the ones transformers cached when it ran those
        positions (each under its own sinks and window), rotated at their absolute
        positions, and the query is rotated at p: a window key is seen at its true
        distance. The sinks are recomputed for each query with their positions shifted by
        p - (S + W), so that a sink j is seen at distance S + W - j, as if the query stood
        right after the cache [sinks; window] (StreamingLLM's "positions within the
        cache"; RoPE makes the sinks' own hidden states independent of the shift).

    One query at a time past the window, so its cost is (N - S - W - 1) decode steps."""
    S, W, N = sinks, window, ids.shape[1]
    head = min(N, S + W + 1)
    with torch.no_grad():
        out = lm(ids[:, :head], use_cache=True)
        logits = [out.logits[0]]
        # each layer's window for the next query: the W positions before it
        win = [(layer.keys[:, :, S + 1 :], layer.values[:, :, S + 1 :]) for layer in out.cache.layers]
        for p in range(head, N):
            kv = win
            if S:
                shifted = torch.arange(S)[None] + (p - S - W)
                sink = lm.model(ids[:, :S], position_ids=shifted, use_cache=True).cache.layers
                kv = [
                    (torch.cat([s.keys, k], 2), torch.cat([s.values, v], 2))
                    for s, (k, v) in zip(sink, win, strict=True)
                ]
            cache = DynamicCache(kv)
            step = lm(ids[:, p : p + 1], position_ids=torch.tensor([[p]]), cache=cache, use_cache=True)
            logits.append(step.logits[0])
            win = [(layer.keys[:, :, S + 1 :], layer.values[:, :, S + 1 :]) for layer in cache.layers]
    return torch.cat(logits)


def logprobs(lm: torch.nn.Module, case: dict) -> torch.Tensor:
    lm.eval()
    ids = torch.tensor([case["ids"]])
    stream = case.get("streaming")
    with torch.no_grad():
        logits = streaming_logits(lm, ids, stream["sinks"], stream["window"]) if stream else lm(ids).logits[0]
        lp = torch.log_softmax(logits.float(), -1)  # (N, V)
    if case.get("targets_only"):
        lp = lp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return lp.contiguous()


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    for case in cases:
        lm, tok = load(case)
        if lm is not None:
            save_file({"logprobs": logprobs(lm, case)}, str(out / f"{case['name']}.safetensors"))
        texts = case.get("texts", [])
        result = {"tokens": [tok.encode(t, add_special_tokens=False) for t in texts]}
        if case.get("smollm_split"):
            from tokenizers import pre_tokenizers

            tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False),
                ]
            )
            result["tokens_smollm"] = [tok.encode(t, add_special_tokens=False) for t in texts]
        (out / f"{case['name']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
