"""A bad row fails alone (issue 25, attacks 1 and 8; issue 38, item 3).

Attack 1: an imported state claiming 2**63 - 8 consumed tokens (valid checksum, full
memory) overflowed inside the shared decode step, and the engine failed the whole batch:
another tenant lost most of its generations. Now every state is validated when it is
loaded (its token count within the family's bound), and a batched step that still fails
is retried row by row, so only the offending request fails.

Attack 8: a state full of 3e38 (finite, so it passed every check) was accepted; its first
generation committed a NaN state, which then failed fork and export with 500. Now a step
that produces non-finite values fails its request clearly and commits nothing.

Issue 38: each way a batched step can fail is met by a row whose own data makes it fail,
beside three good rows that must finish with exactly the tokens each gets alone:

- the batched prefill raises (`Runner._retry_alone`, from `prefill`): a live state whose
  memory is longer than its bound (`states.past_its_bound`); alone it raises again, and fails;
- the batched sampling raises (`_retry_alone`, from `decode`): a request whose logit_bias
  names a token outside the vocabulary; alone it raises again, and fails;
- the batched decode forward raises after the tokens went out (`_consume_alone`): the
  same state with no prompt, so that it meets the others in a decode step at once;
- splitting the batch raises (`_unbatch`, row by row): a token count at int64's edge,
  which overflows in the step.

No state that loading accepts makes a step raise (the families' forwards are total over
valid states; the nearest, a state full of 3e38, turns non-finite instead, and fails by
that path: the HTTP test below). So the raising rows are what loading or the API refuses:
a live state (as the hot cache holds them) or a request's own sampling controls (the API
checks token ids; the engine does not).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import model
from app.engine import Engine, Finished, Request, Stored
from model import IN_PLACE, LanguageModel, State
from model.sampling import SamplingParams
from model.state import Persist
from tests.app.engine_requests import engine_for
from tests.app.sse_client import events
from tests.faults.harness import stream_events

from .conftest import ATTACKER, as_key, assert_error
from .states import NEAR_INT64_MAX, blob_with, past_its_bound, state_after

FAMILIES = ["txl", "rlt"]
IMPORT = {"Content-Type": "application/octet-stream"}
GREEDY = SamplingParams(temperature=0.0)
# the good rows sample, each with its own seed: the tiny random models' greedy tokens hardly
# depend on the context, so only sampled ones tell one row's tokens from another's
SAMPLED = SamplingParams(temperature=1.0, ignore_eos=True)
GOOD_PROMPTS = ([5, 6], [7, 8], [9, 10])  # (one length: the rows share every prefill chunk)
BAD_PROMPT = [11, 12]
MAX_TOKENS = 12


@dataclass(frozen=True)
class Poison:
    """The bad row of a shared batch, and which of the batch's failure paths it reaches."""

    start: Callable[[LanguageModel, State], State | Stored]  # its starting state
    prompts: bool  # whether every row sends a prompt (else they meet in a decode step at once)
    params: Callable[[LanguageModel], SamplingParams] = lambda lm: GREEDY
    fails: bool = True  # (a row whose split mends it goes on)
    in_the_model: bool = True  # the model's own step raises (not the sampler, not the split)


POISONS = {
    # `_retry_alone` from `prefill`
    "prefill-raises": Poison(past_its_bound, prompts=True),
    # `_retry_alone` from `decode`
    "sampling-raises": Poison(
        lambda lm, state: _stored(state),
        prompts=True,
        params=lambda lm: SamplingParams(temperature=0.0, logit_bias={lm.config.vocab_size + 1: 1.0}),
        in_the_model=False,
    ),
    # `_consume_alone`: the batch's split trims its memory to the bound, and alone it goes on
    "decode-forward-raises": Poison(past_its_bound, prompts=False, fails=False),
    # `_unbatch`'s row-by-row split
    "split-raises": Poison(
        lambda lm, state: state.replace(n_tokens=torch.tensor([NEAR_INT64_MAX])),
        prompts=True,
        in_the_model=False,
    ),
}


def _stored(state: State) -> Stored:
    return Stored(state.to_bytes(), (), int(state.n_tokens[0]))


def _run(lm: LanguageModel, requests: list[Callable[[], Request]], together: bool) -> list[object]:
    """Each request's outcome (or exception), in one engine: all queued before it starts, so
    that they share every step, or one after another, each alone."""

    async def go() -> list[object]:
        engine: Engine = engine_for(lm, cpu_threads=1)
        try:
            if together:
                reqs = [engine.submit(make()) for make in requests]
                engine.start()
                return await asyncio.gather(*(r.finished() for r in reqs), return_exceptions=True)
            engine.start()
            return [await engine.submit(make()).finished() for make in requests]
        finally:
            engine.stop()

    return asyncio.run(go())


def _batched_step_raises(lm: LanguageModel, poison: Poison, starts: list[State]) -> bool:
    """Whether the step the rows first share raises on the model itself, batched (the
    path the test is about starts there): their prefill, or their decode forward (the
    sampling's logits, before it, must not)."""
    batch = lm.stack_states([s.clone() for s in starts])
    with torch.no_grad():
        if not poison.prompts:
            lm.next_logits(batch)
        try:
            if poison.prompts:
                lm.prefill(torch.tensor([BAD_PROMPT] * len(starts)), batch)
            else:
                lm(torch.zeros(len(starts), 1, dtype=torch.long), batch, IN_PLACE)
        except Exception:
            return True
    return False


@pytest.mark.parametrize("poison", POISONS, ids=list(POISONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_whose_step_fails_fails_alone_in_a_shared_batch(hostile_models, family, poison):
    """The engine itself: three good rows (each from a stored state of its own) and a bad
    one share every step; the bad row's data makes the batched step fail. The good rows
    finish every token, each exactly as it does alone (seeded, the same tokens; its state's
    next logits within float error); the bad row fails."""
    lm = model.load(hostile_models[family], device="cpu")
    p = POISONS[poison]
    goods = [state_after(lm, list(range(i, i + 40))) for i in (1, 2, 3)]
    bad_start = p.start(lm, state_after(lm, list(range(4, 44))))
    prompts = GOOD_PROMPTS if p.prompts else ([], [], [])

    def good(i: int) -> Callable[[], Request]:
        return lambda: Request(
            _stored(goods[i]), list(prompts[i]), SAMPLED, i + 1, MAX_TOKENS, [], persist=Persist()
        )

    def bad() -> Request:
        prompt = BAD_PROMPT if p.prompts else []
        return Request(bad_start, prompt, p.params(lm), None, MAX_TOKENS, [], persist=Persist())

    if p.in_the_model:  # (else the poison is plain to see: the sampler's check, the overflow)
        assert isinstance(bad_start, State)
        assert _batched_step_raises(lm, p, [goods[0], goods[1], bad_start, goods[2]])
    alone = _run(lm, [good(0), good(1), good(2)], together=False)
    shared = _run(lm, [good(0), good(1), bad, good(2)], together=True)
    if p.fails:
        assert isinstance(shared[2], Exception), shared[2]
    for res, ref in zip((shared[0], shared[1], shared[3]), alone, strict=True):
        assert isinstance(res, Finished), res
        assert isinstance(ref, Finished)
        assert res.token_ids == ref.token_ids and len(res.token_ids) == MAX_TOKENS
        assert res.state.finite() and res.n_tokens == ref.n_tokens
        torch.testing.assert_close(lm.next_logits(res.state), lm.next_logits(ref.state), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_import_claiming_2_63_tokens_is_refused(hostile_servers, hostile_models, family):
    """Attack 1's blob never reaches a batch: loading refuses its token count (a live state
    at int64's edge, which only the engine can be handed, fails alone: above)."""
    blob = blob_with(hostile_models[family], n_tokens=NEAR_INT64_MAX)
    with hostile_servers[family].client() as c:
        r = c.post("/v1/sessions/import", content=blob, headers=IMPORT)
        assert_error(r, 422, "invalid_state")
        assert "past the most a stream" in r.json()["error"]["message"]


OTHERS, OTHER_TOKENS = 8, 200  # (under the stream buffer, 256 unread tokens: no stream pauses)
ROUNDS = 3  # a round in which a stream ended before the poisoned request failed proves nothing
# finite, so import accepts it; its first step overflows (Transformer-XL's 3e38 would already
# give non-finite logits: issue 39 refuses such a state at import)
OVERFLOWS = 1e30


def test_an_accepted_state_that_turns_non_finite_fails_only_its_request_beside_eight_streams(tenants):
    """Over HTTP: a state full of 1e30 is accepted by import (it is finite). Its generation
    starts while eight seeded streams decode (one key, so fairness parks none of them: all
    nine share every step) and fails, 422 invalid_state; each of the eight streams exactly
    the text it streams alone on the quiet server, and the poisoned session keeps its
    imported version. A round counts only if every stream was still running when the
    poisoned request failed (a loaded machine can delay the poisoned request that long):
    one of `ROUNDS` must count, and every round's texts must be the texts alone."""

    def body(i: int) -> dict:  # (seeded: the tiny model's greedy text hardly depends on the prompt)
        return {"max_tokens": OTHER_TOKENS, "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True}

    def session(c: httpx.Client, prompt: str) -> str:
        r = c.post("/v1/sessions", json={"prompt": prompt})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    prompts = [f"Speak, friend {i}:" for i in range(OTHERS)]
    with as_key(tenants, ATTACKER) as c:
        alone = []
        for i, prompt in enumerate(prompts):
            status, evs = stream_events(c, f"/v1/sessions/{session(c, prompt)}/generate", body(i))
            assert status == 200 and evs[-1][0] == "done", evs[-1]
            alone.append(evs[-1][1]["text"])
    assert len(set(alone)) == OTHERS  # (texts that differ: a row given another's is seen)
    blob = blob_with(Path(tenants.model_dir), fill=OVERFLOWS)

    def round_() -> bool:
        """One round; whether every stream outlasted the poisoned request."""
        with as_key(tenants, ATTACKER) as c:
            sids = [session(c, prompt) for prompt in prompts]
            r = c.post("/v1/sessions/import", content=blob, headers=IMPORT)
            assert r.status_code == 201, r.text
            poisoned = r.json()["id"]
        decoding = threading.Barrier(OTHERS + 1, timeout=120)
        failed = threading.Event()  # the poisoned request has failed

        def other(i: int, sid: str) -> tuple[str, bool]:
            """Its streamed text, and whether the poisoned request had failed when it ended."""
            with (
                as_key(tenants, ATTACKER) as oc,
                oc.stream("POST", f"/v1/sessions/{sid}/generate", json=body(i)) as r,
            ):
                assert r.status_code == 200, r.read()
                it = events(r)
                assert next(it)[0] == "token"
                decoding.wait()
                last = list(it)[-1]
                assert last[0] == "done", last
                return last[1]["text"], failed.is_set()

        with ThreadPoolExecutor(OTHERS) as pool, as_key(tenants, ATTACKER) as c:
            futures = [pool.submit(other, i, sid) for i, sid in enumerate(sids)]
            decoding.wait()  # every stream has its first token: all eight decode, every step
            r = c.post(f"/v1/sessions/{poisoned}/generate", json={"stream": False, "max_tokens": 4})
            failed.set()
            assert_error(r, 422, "invalid_state")
            assert "non-finite" in r.json()["error"]["message"]
            shared = [f.result() for f in futures]
            assert c.get(f"/v1/sessions/{poisoned}").json()["version"] == 0
        assert [text for text, _ in shared] == alone
        return all(after for _, after in shared)

    assert any(round_() for _ in range(ROUNDS)), "in every round a stream ended before the poisoned request"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_whose_step_turns_non_finite_is_never_committed(hostile_servers, hostile_models, family):
    server = hostile_servers[family]
    with server.client() as c:
        r = c.post(
            "/v1/sessions/import",
            content=blob_with(hostile_models[family], fill=OVERFLOWING[family]),
            headers=IMPORT,
        )
        assert r.status_code == 201, r.text  # finite: a valid state, as far as anyone can tell
        sid = r.json()["id"]
        r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4})
        assert_error(r, 422, "invalid_state")
        assert "non-finite" in r.json()["error"]["message"]
        status, evs = stream_events(c, f"/v1/sessions/{sid}/generate", {"prompt": "x", "max_tokens": 4})
        assert status == 200 and evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "invalid_state"
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "abc", "commit": True})
        assert_error(r, 422, "invalid_state")
        # the session stays at its last good version: it exports and forks as it was imported
        assert c.get(f"/v1/sessions/{sid}").json()["version"] == 0
        exported = c.get(f"/v1/sessions/{sid}/state")
        assert exported.status_code == 200
        st = model.load(hostile_models[family], device="cpu").load_state(exported.content)
        huge = float(next(t for t in st.tensors.values() if t.is_floating_point()).max())
        assert st.finite() and huge == pytest.approx(OVERFLOWING[family], rel=1e-6)
        assert c.post(f"/v1/sessions/{sid}/fork").status_code == 201
        # and the server serves everyone else as before
        other = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        assert (
            c.post(f"/v1/sessions/{other}/generate", json={"stream": False, "max_tokens": 4}).status_code
            == 200
        )


# a fill whose state gives finite logits but overflows at its first step
OVERFLOWING = {"txl": 1e30, "rlt": 3e38}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stream_whose_state_turns_non_finite_sends_no_token_first(hostile_servers, hostile_models, family):
    """Issue 39: a streamed generate from a state whose first step overflowed sent its first
    token (drawn from finite logits), then the error; a client showed text the server then
    disowned. A first token now waits for its step to leave the state finite: the error is
    the stream's only event."""
    with hostile_servers[family].client() as c:
        blob = blob_with(hostile_models[family], fill=OVERFLOWING[family])
        r = c.post("/v1/sessions/import", content=blob, headers=IMPORT)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        for body in ({"prompt": "x", "max_tokens": 4}, {"max_tokens": 4}):
            status, evs = stream_events(c, f"/v1/sessions/{sid}/generate", body)
            assert status == 200 and [e for e, _ in evs] == ["error"], evs
            assert evs[0][1]["error"]["type"] == "invalid_state"
        assert c.get(f"/v1/sessions/{sid}").json()["version"] == 0
