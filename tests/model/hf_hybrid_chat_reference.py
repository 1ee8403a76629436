"""The reference side of tests/app/test_hf_hybrid_api.py: run in a subprocess with a current
transformers.

    python tests/model/hf_hybrid_chat_reference.py OUT CASES_JSON

For each case {"name", "kind" (as hf_hybrid_reference.py's KINDS), "config", "seed",
"chats": [{"name", "messages", "max_new_tokens"}]}: build the random checkpoint as
hf_hybrid_reference.py does (its perturbations: the recurrent state matters) and
`save_pretrained` it to OUT/name, where the test has already written the tokenizer files
(tokenizer.json, tokenizer_config.json with its chat template). Then, for each chat in
order, transformers' own way: the tokenizer's `apply_chat_template` renders the messages
with the generation prompt, the tokenizer encodes the text with its special tokens (BOS
first), and the model, in float64 from the saved float32 weights, continues it greedily,
the whole sequence each step (no cache), until the EOS token or the chat's `max_new_tokens`. An
assistant message {"reply_of": NAME} stands for the reply this script gave to chat NAME.
OUT/name/chat_reference.json holds, per chat:
    prompt_ids   the rendered, encoded conversation
    ids          the greedy tokens (the EOS included, when it ended the reply)
    logprobs     log p of each, under the model's distribution at its step
    margins      the gap between the best and the second-best log-prob at each step
    text         the reply as the tokenizer decodes it, without the EOS

This file imports transformers, so it never runs in the main environment.
"""

from __future__ import annotations

import json

import torch
from hf_cases import main  # (this folder: the script's own, first on its path)
from hf_hybrid_reference import random_model
from transformers import AutoTokenizer

EOS = 2  # the tokenizer's <|im_end|>, ChatML's turn stop (tests/model/llama_files.py)


def greedy(model, prompt: list[int], n: int, eos: int) -> dict:
    seq, ids, logprobs, margins = torch.tensor([prompt]), [], [], []
    with torch.no_grad():
        for _ in range(n):
            lp = model(input_ids=seq, use_cache=False).logits[0, -1].double().log_softmax(-1)
            top = lp.topk(2)
            ids.append(int(top.indices[0]))
            logprobs.append(float(top.values[0]))
            margins.append(float(top.values[0] - top.values[1]))
            seq = torch.cat([seq, top.indices[:1][None]], 1)
            if ids[-1] == eos:
                break
    return {"ids": ids, "logprobs": logprobs, "margins": margins}


def run_case(out, case: dict) -> None:
    model, _ = random_model(case, eos_token_id=EOS)
    target = out / case["name"]
    model.save_pretrained(target)
    model = model.double()
    tok = AutoTokenizer.from_pretrained(target)
    replies: dict[str, dict] = {}
    for chat in case["chats"]:
        messages = [
            {"role": "assistant", "content": replies[m["reply_of"]]["text"]} if "reply_of" in m else m
            for m in chat["messages"]
        ]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text)["input_ids"]
        reply = greedy(model, prompt, chat["max_new_tokens"], EOS)
        shown = reply["ids"][:-1] if reply["ids"][-1] == EOS else reply["ids"]
        replies[chat["name"]] = {"prompt_ids": prompt, **reply, "text": tok.decode(shown)}
    (target / "chat_reference.json").write_text(json.dumps(replies))


if __name__ == "__main__":
    main(run_case)
