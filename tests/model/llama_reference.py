"""Reference log-probs and token ids from HF transformers (a current release, with gguf), for
tests/model/test_llama_parity.py and the shipped model's by-hand check (docs/MODEL_CARD.md).

Runs in a subprocess with `.venv-ref-current/` first on the path (tests/model/reference_env.py).
Usage: python llama_reference.py OUT CASES_JSON, where CASES_JSON lists cases:

  {"name", "kind": "gguf", "dir", "file", "ids": [...], "texts": [...]}
      AutoModelForCausalLM / AutoTokenizer .from_pretrained(dir, gguf_file=file), fp32
  {"name", "kind": "hf", "dir", "config": {...}, "seed", "ids": [...], "texts": [...]}
      a random LlamaForCausalLM / MistralForCausalLM (config["model_type"]) written to dir
      with save_pretrained (safetensors) beside the tokenizer files the test wrote there

For each case it writes OUT/<name>.safetensors (`logprobs`: log_softmax of the logits over
`ids` in one pass, [N, V], or with "targets_only" just the log-prob of each next id, [N-1];
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
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig


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


def logprobs(lm: torch.nn.Module, case: dict) -> torch.Tensor:
    lm.eval()
    ids = torch.tensor([case["ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(lm(ids).logits[0].float(), -1)  # (N, V)
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
