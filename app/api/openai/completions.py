"""OpenAI-compatible routes: `POST /v1/completions` and `GET /v1/models`.

A completion runs in a recur session: the body field `session_id` or the `X-Session-Id`
header continues one (its recurrent state is the context, so the prompt only needs the
new text); without either, a new session is created. Either way the session's id comes
back in the `X-Session-Id` header and the body, and the generation is committed to it
exactly as `POST /v1/sessions/{id}/generate` would (the same transaction: app/sessions/).
`prompt` takes OpenAI's four forms; an array of several prompts is a batch, one choice
(and one new session) per prompt; with `n`, n choices per prompt, the others in forks of
its session. What the OpenAI routes share is in framing.py.

Stop strings and stop tokens are left out of `text` (OpenAI's semantics; vLLM's
`include_stop_str_in_output` keeps them), though the session's state has consumed them.
`logprobs: k` gives each sampled token's behaviour log-prob (model/sampling.py) and its k
most probable alternatives under the same distribution; `echo` puts the prompt's text
(and, not streamed, its tokens' log-probs: the model's own) first.

Deviations from OpenAI: `best_of` is 1, and `usage.prompt_tokens` counts each of the `n`
choices' prompt (each consumes it in its own session). Errors keep
recur's body, `{"error": {"type", "message"}}`, which the openai SDK raises as its usual
exceptions; mid-stream, an error is a data chunk `{"error": ...}`, which the SDK raises
too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from fastapi import APIRouter, Request, Response
from sse_starlette import EventSourceResponse

from app.config import Settings
from app.engine import Alternatives, Engine, Logprobs, TokenEvent

from ..http.deps import (
    EngineDep,
    OwnerDep,
    ServicesDep,
    SessionIdHeader,
    SessionsDep,
    SettingsDep,
    prompt_ids,
)
from ..http.errors import ApiError, ErrorType
from . import framing as oai
from .schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResult,
    CompletionUsage,
    ModelCard,
    ModelList,
    SamplingDefaults,
)

router = APIRouter(prefix="/v1", tags=["openai"])

_STARTED = time.time()


@router.get("/models", response_model=ModelList, summary="The served model (OpenAI format)")
async def list_models(engine: EngineDep, services: ServicesDep) -> ModelList:
    lm = engine.lm
    card = ModelCard(
        id=engine.name,
        created=int(_STARTED),
        family=lm.family,
        vocab_size=engine.vocab_size,
        context_window=lm.context_window,
        precision=lm.precision,
        chat_template=services.chat_template is not None,
        sampling_defaults=SamplingDefaults(**dataclasses.asdict(lm.generation_config)),
    )
    return ModelList(data=[card])


Scored = tuple[str, float | None, Alternatives]  # a token's text, log-prob and alternatives


@dataclass(frozen=True)
class _Logprobs:
    """OpenAI's `logprobs` object of a run of tokens, with `top` alternatives each (by
    their text; where two share a text, the more probable one's)."""

    token_text: Callable[[int], str]
    top: int

    def of(self, tokens: Sequence[Scored], offset: int) -> CompletionLogprobs:
        lengths = [len(text) for text, _, _ in tokens]
        return CompletionLogprobs(
            tokens=[text for text, _, _ in tokens],
            token_logprobs=[lp for _, lp, _ in tokens],
            top_logprobs=[None if lp is None else self._by_text(alts) for _, lp, alts in tokens]
            if self.top
            else None,
            text_offset=list(accumulate(lengths[:-1], initial=offset)) if tokens else [],
        )

    def _by_text(self, alternatives: Alternatives) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, lp in alternatives:
            out.setdefault(self.token_text(i), lp)
        return out


def _sampled(events: Sequence[TokenEvent]) -> list[Scored]:
    return [(ev.text, ev.logprob, ev.top) for ev in events]


@router.post(
    "/completions",
    response_model=CompletionResult,
    response_model_exclude_none=False,
    summary="OpenAI-compatible text completion, in a new or a continued session",
    responses=oai.route_responses(CompletionResult, "completion chunk"),
)
async def create_completion(
    body: Completion,
    request: Request,
    response: Response,
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    x_session_id: SessionIdHeader = None,
) -> CompletionResult | EventSourceResponse:
    started = time.perf_counter()
    engine = sessions.engine
    sid = oai.continued(body, engine, x_session_id)
    prompts = [prompt_ids(engine, settings.max_prompt_tokens, p) for p in _prompts(body.prompt, settings)]
    if body.echo and body.logprobs is not None and body.stream:
        raise ApiError(ErrorType.invalid_request, "echo with logprobs is not streamed: send stream: false")
    choices = await oai.start(
        sessions,
        settings,
        owner,
        sid,
        prompts,
        oai.generation(
            body,
            settings,
            body.max_tokens,
            engine,
            stop=oai.stop_strings(body.stop),
            logprobs=Logprobs(top=body.logprobs or 0, prompt=body.echo and body.logprobs is not None),
            started=started,
        ),
        n=body.n or 1,
        include_stop=body.include_stop_str_in_output,
        user=body.user,
    )
    lp = None if body.logprobs is None else _Logprobs(engine.tokenizer.token_text, body.logprobs)
    echoed = [_prompt_texts(engine, ids) if body.echo else [] for ids in prompts]
    framer = _Chunks(oai.head("cmpl", engine.name, engine.fingerprint, choices), lp, echoed)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return oai.stream(choices, framer, include_usage, settings.stream_send_timeout)
    await oai.complete(choices, request)
    response.headers.update(oai.session_header(choices))
    entries = [framer.whole(c) for c in choices.items]
    return CompletionResult(**framer.head, choices=entries, usage=choices.usage(), session=entries[0].session)


def _prompt_texts(engine: Engine, ids: list[int]) -> list[str]:
    """Each prompt token's text as a stream decodes it (so they add up to the prompt's text)."""
    decoder = engine.tokenizer.stream_decoder()
    texts = [decoder.feed(i) for i in ids]
    if texts:
        texts[-1] += decoder.flush()
    return texts


def _prompts(
    prompt: str | list[int] | list[str] | list[list[int]], settings: Settings
) -> list[str] | list[list[int]]:
    """The prompts of a body, in OpenAI's four forms: text, ids, or an array of either."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):  # ids ([] too: one empty prompt)
        return [[x for x in prompt if isinstance(x, int)]]
    if len(prompt) > settings.max_batch_size:
        raise ApiError(
            ErrorType.invalid_request,
            f"prompt: a batch of {len(prompt)} prompts; this server runs at most {settings.max_batch_size} "
            "(max_batch_size) in one request",
        )
    return prompt  # type: ignore[return-value]  # a list of ids or of strings, not mixed (the schema)


@dataclass
class _Chunks:
    """The response's shapes: `text_completion` chunks, one choice each, or whole choices."""

    head: dict[str, Any]
    logprobs: _Logprobs | None
    echoed: list[list[str]]  # per prompt, its tokens' texts when echoed

    def __post_init__(self) -> None:
        self.offsets: dict[int, int] = {}  # each choice's text_offset so far

    def whole(self, choice: oai.Choice) -> CompletionChoice:
        """A choice not streamed: the echoed prompt (with its log-probs), then its text."""
        echoed, res = self.echoed[choice.prompt], choice.run.result
        prompt_top = res.prompt_top or [()] * len(echoed)
        scored = []
        if echoed and self.logprobs:  # the prompt's log-probs exist only when logprobs asked for them
            scored = list(zip(echoed, res.prompt_logprobs, prompt_top, strict=True))
        return CompletionChoice(
            index=choice.index,
            text="".join(echoed) + choice.text.whole(choice.run.tokens),
            logprobs=self.logprobs.of([*scored, *_sampled(choice.run.tokens)], 0) if self.logprobs else None,
            finish_reason=choice.finish_reason,
            session=choice.ref(),
        )

    def chunk(self, entries: list[Any], usage: CompletionUsage | None) -> CompletionResult:
        first = next((e for e in entries if isinstance(e, CompletionChoice) and e.index == 0), None)
        return CompletionResult(
            **self.head, choices=entries, usage=usage, session=first.session if first else None
        )

    def opening(self, choice: oai.Choice) -> CompletionChoice | None:
        echoed = "".join(self.echoed[choice.prompt])  # (echo with logprobs is not streamed)
        self.offsets[choice.index] = len(echoed)
        return CompletionChoice(index=choice.index, text=echoed, finish_reason=None) if echoed else None

    def token(self, choice: oai.Choice, event: TokenEvent | None, text: str) -> CompletionChoice:
        lp = None
        if self.logprobs and event is not None:
            offset = self.offsets.get(choice.index, 0)
            lp = self.logprobs.of(_sampled([event]), offset)
            self.offsets[choice.index] = offset + len(event.text)
        return CompletionChoice(index=choice.index, text=text, logprobs=lp, finish_reason=None)

    def closing(self, choice: oai.Choice) -> CompletionChoice:
        return CompletionChoice(
            index=choice.index, text="", finish_reason=choice.finish_reason, session=choice.ref()
        )
