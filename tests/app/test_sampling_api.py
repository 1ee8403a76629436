"""The sampling and output controls over real HTTP (real Redis, both families): penalties,
min_p, logit_bias, stop_token_ids, ignore_eos and min_tokens on the session generate route
and /v1/completions; what each returns of a stop; top_logprobs and echo; and the 422s.

The central check: the tokens and behaviour log-probs the server returns are the ones
`model.sampling` gives, recomputed here step by step from the model's own logits with the
same parameters and each step's context (the request's prompt and its output so far)."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

import model
from model.sampling import Context, SamplingParams, behaviour_logprobs, draw, make_generator
from tests.app.sse_client import generate as stream_generate
from tests.conftest import ServerProcess

EOS = 257  # the byte tokenizer's
ABC = {str(b): 100.0 for b in b"abc"}  # only a, b and c can win against these biases


SERVER_SETTINGS = {"max_tokens": 200}


@pytest.fixture(scope="module")
def server(server_of_each_family: ServerProcess) -> ServerProcess:
    return server_of_each_family


@pytest.fixture(scope="module")
def lm(server) -> model.LanguageModel:
    return model.load(server.model_dir, device="cpu", precision="fp32")


def new_session(http: httpx.Client, prompt: str = "") -> str:
    r = http.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def generate(http: httpx.Client, sid: str, **body: object) -> dict:
    r = http.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


# every combination a different sampler; the body's fields, and the same as SamplingParams
COMBOS: list[dict] = [
    {"temperature": 0, "repetition_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {"101": 4.0}},
    {"temperature": 0.9, "repetition_penalty": 1.5, "top_k": 30, "seed": 1},
    {"temperature": 1.1, "presence_penalty": 1.5, "frequency_penalty": 0.7, "min_p": 0.02, "seed": 2},
    {"temperature": 1.0, "logit_bias": {"32": 2.0, "10": -100}, "top_p": 0.9, "seed": 3},
    {"temperature": 0.8, "min_tokens": 10, "stop_token_ids": [32, 101], "logit_bias": {"32": 3.0}, "seed": 4},
    {"temperature": 0.7, "repetition_penalty": 0.9, "frequency_penalty": -0.5, "min_p": 0.1, "seed": 5},
    {"temperature": 1.0, "ignore_eos": True, "logit_bias": {str(EOS): 5.0}, "seed": 6},
]


def params_of(body: dict) -> SamplingParams:
    fields = {k: v for k, v in body.items() if k != "seed"}
    fields["logit_bias"] = {int(k): float(v) for k, v in fields.get("logit_bias", {}).items()}
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids", ()))
    return SamplingParams(**fields)


@torch.no_grad()
def expected(lm: model.LanguageModel, before: list[int], prompt: list[int], body: dict, tokens: list[int]):
    """Step through the returned tokens from the session's state (`before`, BOS included,
    then the request's `prompt`): each step's behaviour log-prob of the token under the
    shared transform, and the token a sampler seeded like the server's draws there."""
    params = params_of(body)
    _, state = lm.consume(before + prompt, lm.new_state(1))
    gen = make_generator(body.get("seed"))
    logprobs, drawn = [], []
    for i, tok in enumerate(tokens):
        logits = lm.next_logits(state)
        ctx = Context.of([prompt], [tokens[:i]], logits.shape[-1], eos_id=EOS)
        logprobs.append(float(behaviour_logprobs(logits, [params], torch.tensor([tok]), ctx)[0]))
        drawn.append(int(draw(logits, [params], [gen], ctx).ids[0]))
        _, state = lm(torch.tensor([[tok]]), state)
    return logprobs, drawn


@pytest.mark.parametrize("body", COMBOS, ids=[f"combo{i}" for i in range(len(COMBOS))])
def test_tokens_and_logprobs_are_the_shared_transforms(http, lm, body):
    sid = new_session(http, "ROMEO:")
    out = generate(http, sid, prompt=" O Juliet", max_tokens=24, logprobs=True, **body)
    tokens = [t["id"] for t in out["tokens"]]
    logprobs, drawn = expected(lm, [256, *b"ROMEO:"], list(b" O Juliet"), body, tokens)
    assert drawn == tokens  # the same draw from the same distribution
    for got, want in zip([t["logprob"] for t in out["tokens"]], logprobs, strict=True):
        assert math.isfinite(want) and abs(got - want) <= 1e-4, (got, want)
    # the transcript records the parameters as JSON, and they come back equal
    seg = http.get(f"/v1/sessions/{sid}/transcript").json()["segments"][-1]
    assert SamplingParams(**seg["sampling"]) == params_of(body)


def test_rows_with_different_controls_share_decode_steps(server, http):
    """All the combinations at once: batched together, each gets what it got alone."""
    alone = []
    for body in COMBOS:
        sid = new_session(http, "ROMEO:")
        alone.append(generate(http, sid, prompt=" O", max_tokens=30, logprobs=True, **body)["tokens"])
    sids = [new_session(http, "ROMEO:") for _ in COMBOS]
    before = _metric(http, "recur_decode_steps_total")

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            rs = await asyncio.gather(
                *(
                    c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "prompt": " O", "max_tokens": 30,
                                                                   "logprobs": True, **body})
                    for sid, body in zip(sids, COMBOS, strict=True)
                )
            )  # fmt: skip
        return [r.json()["tokens"] for r in rs]

    together = asyncio.run(run_all())
    for a, t in zip(alone, together, strict=True):
        assert [x["id"] for x in a] == [x["id"] for x in t]
        assert all(abs(x["logprob"] - y["logprob"]) <= 1e-4 for x, y in zip(a, t, strict=True))
    steps = _metric(http, "recur_decode_steps_total") - before
    assert steps < sum(len(t) for t in together)  # rows shared steps
    assert _metric(http, "recur_decode_batch_max") > 1


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


# -- stopping -------------------------------------------------------------------------------
def test_stop_token_ids_end_the_generation_and_min_tokens_holds_them_back(http):
    sid = new_session(http, "x")
    # a is overwhelmingly likely: as a stop id, it ends the generation at once...
    out = generate(
        http, sid, max_tokens=20, temperature=1.0, seed=0, logit_bias={"97": 100}, stop_token_ids=[97]
    )
    assert [t["id"] for t in out["tokens"]] == [97] and out["finish_reason"] == "stop"
    assert out["text"] == "a"  # the session route keeps what the state consumed
    # ...unless min_tokens holds it back: then it comes as the (min_tokens + 1)th token
    out = generate(
        http,
        sid,
        max_tokens=20,
        temperature=1.0,
        seed=0,
        logit_bias={"97": 100},
        stop_token_ids=[97],
        min_tokens=5,
    )
    ids = [t["id"] for t in out["tokens"]]
    assert len(ids) == 6 and 97 not in ids[:5] and ids[5] == 97 and out["finish_reason"] == "stop"


def test_eos_min_tokens_and_ignore_eos(http):
    sid = new_session(http, "x")
    eos = {str(EOS): 100}
    out = generate(http, sid, max_tokens=20, temperature=1.0, seed=0, logit_bias=eos, min_tokens=3)
    assert [t["id"] for t in out["tokens"]][3:] == [EOS] and out["finish_reason"] == "eos"
    out = generate(http, sid, max_tokens=6, temperature=1.0, seed=0, logit_bias=eos, ignore_eos=True)
    assert [t["id"] for t in out["tokens"]] == [EOS] * 6 and out["finish_reason"] == "length"
    # min_tokens past max_tokens holds EOS back to the end (it counts as max_tokens: the
    # transcript records that)
    sid = new_session(http, "x")
    out = generate(http, sid, max_tokens=5, temperature=1.0, seed=0, logit_bias=eos, min_tokens=500)
    assert EOS not in [t["id"] for t in out["tokens"]] and out["finish_reason"] == "length"
    assert http.get(f"/v1/sessions/{sid}/transcript").json()["segments"][-1]["sampling"]["min_tokens"] == 5


def test_stop_strings_are_left_out_on_the_openai_routes_but_consumed(oa, http):
    """Greedy over a, b, c only (logit_bias): a known text, then the same with a stop string
    from its middle: the session route keeps it, /v1/completions leaves it (and what its
    last token carried after it) out unless include_stop_str_in_output; the session's state
    has consumed every sampled token either way."""
    sid = new_session(http, "x")
    text = generate(http, sid, max_tokens=12, temperature=0, logit_bias=ABC)["text"]
    assert set(text) <= set("abc") and len(text) == 12
    stop = text[4:6]
    at = text.index(stop)
    sid = new_session(http, "x")
    kept = generate(http, sid, prompt="", max_tokens=12, temperature=0, logit_bias=ABC, stop=[stop])
    assert kept["text"] == text[: at + 2] and kept["finish_reason"] == "stop"

    common = dict(model="tiny", prompt="x", max_tokens=12, temperature=0, logit_bias=ABC, stop=[stop])
    c = oa.completions.create(**common)
    assert c.choices[0].text == text[:at] and c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens == at + 2
    assert http.get(f"/v1/sessions/{c.session_id}").json()["n_tokens"] == 1 + 1 + at + 2  # type: ignore[attr-defined]
    with_stop = oa.completions.create(**common, extra_body={"include_stop_str_in_output": True})
    assert with_stop.choices[0].text == text[: at + 2]
    streamed = oa.completions.create(**common, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text[:at]


def test_a_stop_token_is_left_out_on_the_openai_routes(oa):
    common = dict(model="tiny", prompt="x", max_tokens=12, temperature=0, logit_bias=ABC)
    text = oa.completions.create(**common).choices[0].text
    stop_id = ord(text[3])
    first = text.index(text[3])
    c = oa.completions.create(**common, extra_body={"stop_token_ids": [stop_id]})
    assert c.choices[0].text == text[:first] and c.usage.completion_tokens == first + 1
    c = oa.completions.create(
        **common, extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True}
    )
    assert c.choices[0].text == text[: first + 1]


def test_stop_strings_wait_for_min_tokens(oa, http):
    sid = new_session(http, "x")
    only_a = {"97": 100}
    out = generate(http, sid, max_tokens=10, temperature=0, logit_bias=only_a, stop=["a"], min_tokens=3)
    assert out["text"] == "aaa" and out["finish_reason"] == "stop"
    c = oa.completions.create(
        model="tiny", prompt="x", max_tokens=10, temperature=0, logit_bias=only_a, stop=["a"],
        extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert c.choices[0].text == "aa" and c.usage.completion_tokens == 3  # cut at the stop that ended it


# -- log-probs --------------------------------------------------------------------------------
def test_top_logprobs_on_the_session_route(http, lm):
    sid = new_session(http, "ROMEO:")
    body = {"prompt": " O", "max_tokens": 8, "temperature": 0.9, "top_k": 3, "seed": 9, "logprobs": True}
    out = generate(http, sid, top_logprobs=5, **body)
    for t in out["tokens"]:
        top = t["top_logprobs"]
        assert len(top) == 3  # top_k 3: only three tokens could be drawn
        assert [x["logprob"] for x in top] == sorted((x["logprob"] for x in top), reverse=True)
        assert t["id"] in [x["id"] for x in top]
        assert next(x["logprob"] for x in top if x["id"] == t["id"]) == t["logprob"]
        assert all(x["text"] == lm.tokenizer.token_text(x["id"]) for x in top)
    assert math.isclose(
        sum(math.exp(x["logprob"]) for x in out["tokens"][0]["top_logprobs"]), 1, rel_tol=1e-4
    )
    # streamed: the same alternatives in each token event
    sid = new_session(http, "ROMEO:")
    tokens, final, _ = stream_generate(http, sid, top_logprobs=5, **body)
    assert final == "done" and [t["id"] for t in tokens] == [t["id"] for t in out["tokens"]]
    for a, b in zip(tokens, out["tokens"], strict=True):
        assert [x["id"] for x in a["top_logprobs"]] == [x["id"] for x in b["top_logprobs"]]
        assert all(
            abs(x["logprob"] - y["logprob"]) <= 1e-6
            for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True)
        )
    # top_logprobs implies logprobs; without either, neither
    sid = new_session(http, "ROMEO:")
    implied = generate(http, sid, top_logprobs=5, **{**body, "logprobs": False})
    assert [[x["id"] for x in t["top_logprobs"]] for t in implied["tokens"]] == [
        [x["id"] for x in t["top_logprobs"]] for t in out["tokens"]
    ]
    sid = new_session(http, "ROMEO:")
    plain = generate(http, sid, **{**body, "logprobs": False})
    assert all("logprob" not in t and "top_logprobs" not in t for t in plain["tokens"])


def test_completions_logprobs_with_alternatives(oa, http, lm):
    c = oa.completions.create(
        model="tiny", prompt="ROMEO:", max_tokens=6, temperature=1.0, seed=4, logprobs=4
    )
    lp, n = c.choices[0].logprobs, c.usage.completion_tokens
    assert lp is not None and lp.top_logprobs is not None and len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for alts in lp.top_logprobs:
        assert 1 <= len(alts) <= 4 and list(alts.values()) == sorted(alts.values(), reverse=True)
    # the same request on the session route gives the token ids
    same = generate(http, new_session(http), prompt="ROMEO:", max_tokens=6, temperature=1.0, seed=4)
    assert same["text"] == c.choices[0].text
    tokens = [t["id"] for t in same["tokens"]]
    want, _ = expected(lm, [256], list(b"ROMEO:"), {"temperature": 1.0, "seed": 4}, tokens)
    assert all(abs(a - b) <= 1e-4 for a, b in zip(lp.token_logprobs, want, strict=True))
    # at temperature 1 with nothing cut, the alternatives are the model's own most probable
    # tokens, by text (where two tokens share a text, the more probable one's log-prob)
    _, state = lm.consume([256, *b"ROMEO:"], lm.new_state(1))
    first = torch.log_softmax(lm.next_logits(state)[0].float(), -1).topk(4)
    by_text: dict[str, float] = {}
    for i, v in zip(first.indices.tolist(), first.values.tolist(), strict=True):
        by_text.setdefault(lm.tokenizer.token_text(i), v)
    assert list(by_text) == list(lp.top_logprobs[0])
    assert all(abs(by_text[k] - v) <= 1e-4 for k, v in lp.top_logprobs[0].items())


def test_echo_returns_the_prompt_and_its_logprobs(oa, http, lm):
    scored = oa.completions.create(model="tiny", prompt="ROMEO: O", max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == "ROMEO: O" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens == list("ROMEO: O")
    want, _ = lm.consume([256, *b"ROMEO: O"], lm.new_state(1))
    assert all(abs(a - b) <= 1e-4 for a, b in zip(lp.token_logprobs, want[0, 1:].tolist(), strict=True))
    # two alternatives a position, but one where both are bytes that print as U+FFFD (OpenAI's
    # top_logprobs is keyed by text: the more probable one's stands)
    assert lp.top_logprobs is not None and all(1 <= len(a) <= 2 for a in lp.top_logprobs)
    assert sum(len(a) == 2 for a in lp.top_logprobs) >= len(lp.top_logprobs) // 2
    # the session consumed the prompt, as a score commit would
    assert http.get(f"/v1/sessions/{scored.session_id}").json()["n_tokens"] == 1 + 8  # type: ignore[attr-defined]

    # with a completion: the prompt's text first, then the completion's; offsets over both
    c = oa.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, echo=True, logprobs=0)
    plain = oa.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == "Hi" + plain.choices[0].text
    assert lp is not None and lp.top_logprobs is None and len(lp.token_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # without logprobs: just the text, streamed or not (the prompt in the first chunk)
    echoed = oa.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == c.choices[0].text and echoed.choices[0].logprobs is None
    chunks = [ch.choices[0].text for ch in oa.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, temperature=0, echo=True, stream=True) if ch.choices]  # fmt: skip
    assert chunks[0] == "Hi" and "".join(chunks) == c.choices[0].text


def test_a_repetition_penalty_counts_the_whole_prompt_despite_prefix_reuse(oa, http, server):
    """A stateless request whose prompt extends a committed session could start from that
    session's state (prefix reuse), leaving it only the rest to consume; its repetition
    penalty still counts its whole prompt: the same tokens and log-probs as the same
    prompt in a fresh session. (Any token counted or not moves every log-prob.)"""
    first = oa.completions.create(model="tiny", prompt="abcabc", max_tokens=8, temperature=0)
    prompt = "abcabc" + first.choices[0].text + "ab"
    body = dict(max_tokens=8, temperature=1.0, seed=1)
    penalty = {"repetition_penalty": 1.5}
    again = oa.completions.create(model="tiny", prompt=prompt, logprobs=0, extra_body=penalty, **body)
    fresh = generate(http, new_session(http), prompt=prompt, logprobs=True, **penalty, **body)
    assert again.choices[0].text == fresh["text"]
    lp = again.choices[0].logprobs
    assert lp is not None
    assert all(abs(a - t["logprob"]) <= 1e-4 for a, t in zip(lp.token_logprobs, fresh["tokens"], strict=True))


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stop_token_ids": [300]}, "stop_token_ids"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_invalid_controls_on_the_session_route_are_422_naming_the_field(http, body, field):
    sid = new_session(http)
    r = http.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **body})
    assert r.status_code == 422 and field in r.json()["error"]["message"], r.text
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"258": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ],
)
def test_invalid_controls_on_completions_are_422_naming_the_field(http, body, field):
    r = http.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 422 and field in r.json()["error"]["message"], r.text
