"""Driving the engine directly (no HTTP, no Redis), as the sessions service does: a create,
a score and a generation are each one `Request`."""

from __future__ import annotations

from app.assembly import build_engine
from app.config import Settings
from app.engine import Engine, Finished, Request, Stored
from model.sampling import SamplingParams
from model.state import Persist


def engine_for(lm, **settings) -> Engine:
    """An engine (not started) with the server's default settings but for `settings`."""
    return build_engine(Settings(**settings), lm, "tiny")


async def new_session(engine: Engine, prompt: list[int]) -> Finished:
    """A fresh state with BOS and `prompt` consumed, encoded as a snapshot."""
    bos = engine.tokenizer.bos_id
    return await engine.submit(Request(None, [bos, *prompt], persist=Persist())).finished()


def stored(res: Finished) -> Stored:
    """The state a request finished with, as stored bytes a later request starts from."""
    assert res.encoded is not None and res.encoded.kind == "snapshot"
    return Stored(res.encoded.blob, (), res.n_tokens)


def generate(
    engine: Engine,
    start: Stored,
    prompt: list[int],
    params: SamplingParams,
    *,
    seed: int | None,
    max_tokens: int,
    stop: list[str],
) -> Request:
    """Start a generation; iterate the request for its tokens, then read `.result`."""
    return engine.submit(Request(start, prompt, params, seed, max_tokens, stop, persist=Persist()))


def greedy(
    engine: Engine,
    start: Stored,
    prompt: list[int] | None = None,
    *,
    max_tokens: int,
    stop: list[str] | None = None,
) -> Request:
    """A greedy generation (temperature 0, so no seed): `generate`'s commonest form."""
    return generate(
        engine,
        start,
        prompt or [],
        SamplingParams(temperature=0.0),
        seed=None,
        max_tokens=max_tokens,
        stop=stop or [],
    )


async def score(engine: Engine, start: Stored, tokens: list[int], keep_state: bool) -> Finished:
    """Teacher-forced log-probs of `tokens` (and, with `keep_state`, the new state's bytes)."""
    req = Request(start, tokens, prompt_logprobs=True, persist=Persist() if keep_state else None)
    return await engine.submit(req).finished()
