"""A LLaMA-architecture LLM served as sinks + sliding-window state through the unchanged
session server, over real HTTP (issue 28): a tiny random GGUF file (BPE tokenizer, ChatML
template), its window and sinks set at serve time (`--model-options`), so that the texts
overrun them across request boundaries. The server knows nothing of the family: every
invariant it keeps for the other families must hold here too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import model
from model.replay import Rollout, replay
from model.sampling import SamplingParams
from tests.app.boundaries import assert_scored_alike, create
from tests.app.servers import serve
from tests.app.test_chat import STATUS, ChatProcess
from tests.conftest import ServerProcess

SINKS, WINDOW = 2, 12
SETTINGS = {
    "max_tokens": 100,
    "max_prompt_tokens": 400,
    "cpu_threads": 1,
    "model_options": f"window={WINDOW},sinks={SINKS},tgt_len=8",
    "stateless_session_ttl": 600,
}
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds."


@pytest.fixture(scope="module")
def server(
    tiny_gguf: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from serve(tiny_gguf, redis_url, tmp_path_factory, **SETTINGS)


@pytest.fixture(scope="module")
def lm(tiny_gguf: Path) -> model.LanguageModel:
    return model.load(tiny_gguf, device="cpu", precision="fp32", options=SETTINGS["model_options"])


def generate(http: httpx.Client, sid: str, **body: object) -> dict:
    r = http.post(
        f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 12, "temperature": 0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(result: dict) -> list[int]:
    return [t["id"] for t in result["tokens"]]


def test_the_served_model_is_the_file_with_its_serving_options(oa, lm):
    card = oa.models.list().data[0].model_dump()
    assert (card["id"], card["family"], card["context_window"]) == ("tiny.gguf", "llama", SINKS + WINDOW + 1)
    assert card["vocab_size"] == lm.tokenizer.vocab_size == 384


@pytest.mark.parametrize("cuts", [[1], [5, 6, 7, 14], [13, 14, 15, 30, 31], list(range(3, 40, 7))])
def test_scores_are_the_same_in_one_request_or_many(http, lm, cuts):
    ids = lm.tokenizer.encode(TEXT)
    assert len(ids) > 2 * (SINKS + WINDOW)
    # no BOS (this file's tokenizer adds none): the first token has no context
    assert_scored_alike(http, ids, cuts, max_tokens=12, from_token=1)


def test_state_stays_bounded_as_the_session_grows(http):
    """Past sinks + window the state stops growing: its snapshot keeps one size, and what
    the session stores (a snapshot and the deltas since) stays under two of them."""
    s = create(http, prompt=TEXT)
    snapshots, stored = [], []
    for _ in range(6):
        r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": TEXT[:30], "commit": True})
        assert r.status_code == 200
        snapshots.append(len(http.get(f"/v1/sessions/{s['id']}/state").content))
        stored.append(http.get(f"/v1/sessions/{s['id']}").json()["state_bytes"])
    assert len(set(snapshots)) == 1
    assert max(stored) <= 2 * snapshots[0]


def test_generate_logprobs_are_the_replay_behaviour_logprobs(http, lm):
    prompt = "Now is the winter"
    s = create(http, prompt=prompt)
    body = {
        "max_tokens": 40,
        "temperature": 0.8,
        "top_k": 40,
        "seed": 7,
        "logprobs": True,
        "ignore_eos": True,
    }
    d = generate(http, s["id"], **body)
    rollout = Rollout(
        prompt=lm.tokenizer.encode(prompt),
        response=ids_of(d),
        behaviour_logprobs=[t["logprob"] for t in d["tokens"]],
    )
    assert len(rollout.response) == 40
    ratios = replay(lm, rollout, SamplingParams(temperature=0.8, top_k=40)).ratios
    assert all(r is not None and abs(r - 1) <= 1e-5 for r in ratios), ratios


def test_fork_rollback_export_and_import_continue_as_the_original(http):
    s = create(http, prompt=TEXT)
    v1 = generate(http, s["id"])
    v2 = generate(http, s["id"])
    fork = http.post(f"/v1/sessions/{s['id']}/fork", json={"version": 1}).json()
    assert ids_of(generate(http, fork["id"])) == ids_of(v2)  # greedy from version 1, as before
    r = http.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 1}, headers={"If-Match": '"2"'})
    assert r.status_code == 200 and r.json()["n_tokens"] == v1["session"]["n_tokens"]
    blob = http.get(f"/v1/sessions/{s['id']}/state").content
    r = http.post("/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert ids_of(generate(http, r.json()["id"])) == ids_of(generate(http, s["id"])) == ids_of(v2)


def greedy(lm: model.LanguageModel, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The greedy continuation of `prompt` in-process, from nothing, and its log-probs."""
    import torch

    with torch.no_grad():
        _, state = lm.consume(prompt, lm.new_state(1))
        ids, lps = [], []
        for _ in range(n):
            lp = torch.log_softmax(lm.next_logits(state), -1)[0]
            ids.append(int(lp.argmax()))
            lps.append(float(lp.max()))
            _, state = lm(torch.tensor([ids[-1:]]), state)
    return ids, lps


def test_a_resent_prompt_reuses_its_prefix_with_the_same_answer(http, lm):
    def complete(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    turn1 = complete(lm.tokenizer.encode(TEXT))
    t = http.get(f"/v1/sessions/{turn1['session_id']}/transcript").json()
    history = [i for g in t["segments"] for i in g["ids"]]
    prompt2 = history + lm.tokenizer.encode(" And so")
    turn2 = complete(prompt2)
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
    ids, lps = greedy(lm, prompt2, 6)  # a full prefill
    got = turn2["choices"][0]["logprobs"]
    assert got["tokens"] == [lm.tokenizer.token_text(i) for i in ids]
    assert got["token_logprobs"] == pytest.approx(lps, abs=1e-4)


def test_chat_continues_a_session_with_only_the_new_message(oa: openai.OpenAI, http, lm):
    """The ChatML template from the file's metadata, the turn stopped at <|im_end|> (EOS),
    and each turn sending only its new message: the session holds the whole conversation."""
    first = oa.chat.completions.create(
        model="tiny.gguf",
        messages=[{"role": "user", "content": "Good morrow."}],
        max_tokens=30,
        temperature=0,
    )
    sid = first.session_id  # type: ignore[attr-defined]
    reply = first.choices[0].message.content or ""
    assert "<|im_end|>" not in reply
    second = oa.chat.completions.create(
        model="tiny.gguf",
        messages=[{"role": "user", "content": "And to you."}],
        max_tokens=30,
        temperature=0,
        extra_body={"session_id": sid},
    )
    assert second.session_id == sid  # type: ignore[attr-defined]
    t = http.get(f"/v1/sessions/{sid}/transcript").json()
    text = lm.tokenizer.decode([i for g in t["segments"] for i in g["ids"]])
    assert text.startswith("<|im_start|>user\nGood morrow.<|im_end|>\n<|im_start|>assistant\n" + reply)
    assert "<|im_start|>user\nAnd to you.<|im_end|>\n<|im_start|>assistant\n" in text
    chunks = list(
        oa.chat.completions.create(
            model="tiny.gguf",
            messages=[{"role": "user", "content": "Farewell."}],
            max_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_recur_chat_speaks_through_the_chat_template(server, http, lm):
    """`recur chat` sees the model's chat template (GET /v1/models) and sends each line as a
    user message continuing its session, the system message first."""
    chat = ChatProcess(server.url, "--max-tokens", "8", "--temperature", "0", "--system", "Be brief.")
    try:
        sid, version, n = chat.wait_for(STATUS).groups()
        assert (version, n) == ("0", "0")
        mark = chat.send("Good morrow.")
        m = chat.wait_for(STATUS, mark)
        assert m.groups()[:2] == (sid, "1")
        assert chat.wait_for(STATUS, chat.send("And to you.")).group(2) == "2"
        t = http.get(f"/v1/sessions/{sid}/transcript").json()
        text = lm.tokenizer.decode([i for g in t["segments"] for i in g["ids"]])
        assert text.startswith(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGood morrow.<|im_end|>\n"
        )
        assert text.count("<|im_start|>assistant\n") == 2 and "<|im_start|>user\nAnd to you." in text
        first = next(g for g in t["segments"] if g["version"] == 1)  # the first turn: what it sampled
        reply = lm.tokenizer.decode([i for i, s in zip(first["ids"], first["sampled"], strict=True) if s])
        reply = reply.removesuffix("<|im_end|>")
        assert chat.output[mark : m.start()] == reply + "\n"  # the turn's text, its stop left out
        assert chat.close() == 0
    finally:
        chat.proc.kill()
