"""The hybrids served through the unchanged session server, over real HTTP (issue 43).

Two tiny hybrids whose state matters (tests/conftest.py's HYBRID_TINY, made sensitive by
tests/sensitive.py; tests/app/test_served_models.py holds them, served so, to its bar): a
Gated DeltaNet one served with exact attention, and a Mamba-2 one served with bounded
attention (2 sinks and a window of 24, so the texts here slide it). The server knows
nothing of the family: every route gives them the invariants it gives the others
(tests/app/session_walk.py, tests/app/boundaries.py). Requests in any chunking score alike (the prompts cross
the serving chunk of 8 and the recurrent layers' chunks of 3); the history, fork, rollback,
export and import continue exactly; a state of another family, layer pattern or shape is
refused on import with 422; the OpenAI routes and the Responses API work unchanged; and a
request that reuses a stored prefix (the recurrent matrices, conv windows and keys and
values together) gives the log-probs of a cold run of the whole text, within 1e-5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

import model
from model.chat_template import play_script
from tests.app.boundaries import assert_scored_alike, create
from tests.app.servers import serve
from tests.app.session_walk import (
    assert_a_streamed_generation_is_the_generation,
    assert_history_fork_rollback_export_and_import_continue_exactly,
    assert_the_openai_routes_answer,
    greedy,
    ok,
)
from tests.conftest import HYBRID_TINY, ServerProcess
from tests.sensitive import write_sensitive

A, B = "key-hybrid-a", "key-hybrid-b"
SETTINGS = {
    "api_keys": f"{A},{B}",
    "precision": "fp32",
    "max_tokens": 100,
    "max_prompt_tokens": 400,
    "stateless_session_ttl": 600,
}
# (the served name: its family, the serving options)
HYBRIDS = {
    "gdn-exact": ("gdn-hybrid", "attention=exact,max_context=1024"),
    "mamba2-bounded": ("mamba2-hybrid", "attention=bounded,sinks=2,window=24"),
}
TEXT = "Now is the winter of our discontent made glorious summer — ça va? — by this sun of York."


@pytest.fixture(scope="module", params=list(HYBRIDS))
def server(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    family, options = HYBRIDS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "tiny"
    write_sensitive(path, family=family, seed=0, chat_template=play_script(), **HYBRID_TINY[family])
    yield from serve(path, redis_url, tmp_path_factory, model_options=options, **SETTINGS)


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> model.LanguageModel:
    """The model as the server runs it: its files, its serving options."""
    return model.load(server.model_dir, device="cpu", options=server.settings["model_options"])


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {A}"}) as c:
        yield c


@pytest.mark.parametrize("cuts", [[1], [5, 6, 7, 30], list(range(3, 90, 11))])
def test_scores_are_the_same_in_one_request_or_many(http, cuts):
    assert_scored_alike(http, list(TEXT.encode()), cuts, max_tokens=20)


def test_the_state_grows_with_exact_attention_only(http, served):
    """Exact: the keys and values grow a row per token (one attention layer of one 8-wide
    head: 64 bytes a token); bounded: one size once sinks + window are full. (The exported
    state: what Redis holds is a snapshot and deltas.)"""
    s = create(http, prompt="N" * 30)

    def exported() -> int:
        return len(http.get(f"/v1/sessions/{s['id']}/state").content)

    sizes = [exported()]
    for _ in range(2):
        ok(http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": TEXT, "commit": True}))
        sizes.append(exported())
    grown = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    per_token = 2 * served.config.n_attention * served.config.n_kv_head * served.config.head_dim * 4
    if served.config.attention == "exact":
        assert all(abs(g - per_token * len(TEXT.encode())) < 64 for g in grown), (grown, per_token)
    else:  # (but for the header's few bytes, which may count the tokens)
        assert all(abs(g) < 64 for g in grown), grown


def test_a_streamed_generation_is_the_generation(http):
    assert_a_streamed_generation_is_the_generation(http)


def test_history_fork_rollback_export_and_import_continue_exactly(http):
    assert_history_fork_rollback_export_and_import_continue_exactly(http, "ROMEO: " + TEXT)


def _forged(served: model.LanguageModel, lm: model.LanguageModel) -> bytes:
    """A state of `lm` after some text, its header claiming to be `served`'s."""
    with torch.no_grad():
        _, state = lm(torch.tensor([list(b"Forged by another model.")]), lm.new_state(1))
    tensors = {name: state[name] for name in lm.persistent}
    return model.State(served.family, served.fingerprint, tensors, state.seq_dims, lm.persistent).to_bytes()


def test_a_state_of_another_family_pattern_or_shape_is_refused_on_import(http, served):
    """Refused by its header (another family; another model's fingerprint, which covers the
    pattern), or, its header forged to claim this model, by its shapes (another count of
    recurrent or attention layers, another width)."""
    family = "mamba2-hybrid" if served.family == "gdn-hybrid" else "gdn-hybrid"
    options = {k: getattr(served.config, k) for k in ("attention", "max_context", "sinks", "window")}
    mine = {f.name: getattr(served.config, f.name) for f in dataclasses.fields(served.config)}
    reordered = {**mine, "pattern": served.config.pattern[::-1]}
    foreign = {
        "family": model.build(family, {**HYBRID_TINY[family], **options}).new_state(1).to_bytes(),
        "pattern, same layer counts": model.build(served.family, reordered).new_state(1).to_bytes(),
        "pattern": _forged(served, model.build(served.family, {**mine, "pattern": "rrar"})),
        "shape": _forged(served, model.build(served.family, {**mine, "d_model": 24})),
    }
    for what, blob in foreign.items():
        r = http.post(
            "/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"}
        )
        assert r.status_code == 422, (what, r.text)
        assert r.json()["error"]["type"] == "invalid_state", what


def test_the_openai_routes_and_the_responses_api(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=A, max_retries=0, timeout=120)
    assert_the_openai_routes_answer(oa)
    card = oa.models.list().data[0]
    assert card.model_extra is not None and card.model_extra["family"] in ("gdn-hybrid", "mamba2-hybrid")
    greedy_out = {"temperature": 0, "max_output_tokens": 12}
    first = oa.responses.create(model=card.id, input="Good morrow, fair lady.", **greedy_out)
    second = oa.responses.create(
        model=card.id, input="What news?", previous_response_id=first.id, **greedy_out,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    cold = openai.OpenAI(base_url=server.url + "/v1", api_key=B, max_retries=0, timeout=120)
    whole = cold.responses.create(
        model=card.id, store=False, **greedy_out, include=["message.output_text.logprobs"],
        input=[
            {"role": "user", "content": "Good morrow, fair lady."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What news?"},
        ],
    )  # fmt: skip
    assert whole.usage is not None and whole.usage.input_tokens_details.cached_tokens == 0
    assert whole.output_text == second.output_text
    a, b = second.output[0].content[0].logprobs, whole.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert (
        a and len(a) == len(b) and all(abs(x.logprob - y.logprob) <= 1e-5 for x, y in zip(a, b, strict=True))
    )


def complete(c: httpx.Client, prompt: list[int], n: int = 8) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5}
    return ok(c.post("/v1/completions", json=body))


def test_a_reused_prefix_gives_the_cold_runs_log_probs(server):
    """The whole hybrid state (recurrent matrices, conv windows, keys and values, sinks)
    forked from the stored prefix: the continuation's log-probs, the top 5 at each step
    too, are a cold prefill's of the whole text (key B holds no prefixes) within 1e-5."""
    text = list(b"First Citizen: Before we proceed any further, hear me speak.")
    with (
        server.client(headers={"Authorization": f"Bearer {A}"}) as a,
        server.client(headers={"Authorization": f"Bearer {B}"}) as b,
    ):
        turn1 = complete(a, text)
        t = ok(a.get(f"/v1/sessions/{turn1['session_id']}/transcript"))
        history = [i for g in t["segments"] for i in g["ids"]]
        bos = len(history) - len(text) - len(turn1["choices"][0]["logprobs"]["tokens"])
        prompt2 = history[bos:] + list(b"\nAll: Speak, speak.")
        reused = complete(a, prompt2, 16)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - bos
        cold = complete(b, prompt2, 16)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got, want = reused["choices"][0]["logprobs"], cold["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert g.keys() == w.keys() and all(abs(g[k] - w[k]) <= 1e-5 for k in g)


def test_a_prompt_past_exact_attentions_bound_is_refused_and_commits_nothing(server, http, served):
    """With exact attention a stream holds at most max_context tokens: a request that would
    pass it is refused, 413 prompt_too_long saying why, the session keeps its state, and it
    goes on within the bound."""
    if served.config.attention != "exact":
        pytest.skip("bounded attention has no bound")
    chunk = list(range(1, 256)) + list(range(1, 46))  # 300 tokens
    s = create(http, prompt=chunk)
    for _ in range(2):  # 900 of the 1,024 tokens
        ok(http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": chunk, "commit": True}))
    before = ok(http.get(f"/v1/sessions/{s['id']}"))
    r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": chunk, "commit": True})
    assert r.status_code == 413 and r.json()["error"]["type"] == "prompt_too_long", r.text
    assert "exact attention keeps" in r.json()["error"]["message"]
    after = ok(http.get(f"/v1/sessions/{s['id']}"))
    assert (after["version"], after["n_tokens"]) == (before["version"], before["n_tokens"])
    assert len(greedy(http, s["id"], 8)["tokens"]) == 8
