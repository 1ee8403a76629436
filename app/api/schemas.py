"""The request and response bodies of the HTTP API (pydantic); the OpenAI routes' own are in
openai/schemas.py.

Request models are strict: unknown fields, wrong types, NaN and infinities are rejected
(422). Limits that depend on the served model or the settings (vocabulary, prompt length,
max_tokens cap) are checked by the routers, which know them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from .http.error_types import ErrorType

# A request may ask for more tokens than the server's max_tokens setting (it is capped),
# but not for an absurd number: past this ceiling the body is invalid (422).
MAX_TOKENS_CEILING = 2**20
# Seeds stay within the integers JSON represents exactly everywhere (I-JSON, RFC 7493):
# past 2**53 a client, or a schema validator, that reads numbers as doubles rounds them
SEED_LIMIT = 2**53
MAX_CHOICES = 16  # `n` of the OpenAI routes: each choice is a fork and a generation

# A bound that depends on the served model or the settings is marked `x-limit` in the JSON
# schema (the setting's name, or `vocab`): app/api/http/openapi.py writes the served value into
# the OpenAPI document as its `maximum`; the routers enforce it (422).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-limit": "vocab"})]

Prompt = Annotated[
    str | list[TokenId],
    Field(description="text, or token ids of the served model's vocabulary"),
]


# JSON nested deeper than this is refused (422) before anything walks it: no body of this API
# nests more than a few levels, and a walk of deeper JSON could exhaust Python's stack
MAX_JSON_DEPTH = 32
# JSON may escape half of a UTF-16 surrogate pair alone ("\ud800"); Python reads it as a
# string no UTF-8 encoder, and so no tokenizer, can take: it is not text, and is refused
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBERS = frozenset({int, float, bool, type(None)})  # (and null: what holds no text)
_SCALARS = _NUMBERS | {str}


def _check_json(value: Any) -> None:
    """Raise ValueError if `value` nests deeper than MAX_JSON_DEPTH or holds a string (a
    value or a key) that is not valid Unicode text. One walk, without recursion."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise ValueError(
                    "a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): "
                    "text must be valid Unicode"
                )
        elif isinstance(v, (dict, list)):
            if depth + 1 > MAX_JSON_DEPTH:
                raise ValueError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                todo.extend((k, depth) for k in v)
                todo.extend((x, depth + 1) for x in v.values())
            else:
                kinds = set(
                    map(type, v)
                )  # (a C loop: a list of many small scalars costs no Python step each)
                if kinds == {str}:
                    todo.append(("".join(v), depth))
                elif not kinds <= _NUMBERS:
                    todo.extend((x, depth + 1) for x in v if isinstance(x, (str, dict, list)))


def _integral_floats(value: Any) -> Any:
    """`value` with every float that has no fractional part made an int, in dicts and lists
    (nested at most MAX_JSON_DEPTH deep: `RequestBody` checks that first)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        kinds = set(map(type, value))
        if kinds <= _SCALARS and float not in kinds:
            return value  # (nothing to change: no copy, no Python step per item)
        return [_integral_floats(v) for v in value]
    return value


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: Any) -> Any:
        # JSON has one number type, and JSON Schema's `integer` is any number without a
        # fractional part, 1938.0 too; strict mode would refuse it where an int is expected
        _check_json(data)
        return _integral_floats(data)


class ResponseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------------
class ErrorDetail(ResponseBody):
    type: ErrorType
    message: str


class ErrorBody(ResponseBody):
    error: ErrorDetail


# -- sessions -------------------------------------------------------------------------------
OnDisconnect = Literal["discard", "commit"]
_ON_DISCONNECT = (
    "a client that hangs up before the commit: `discard` commits nothing (the work is cancelled); `commit` "
    "runs to the commit anyway (fenced, as any commit)"
)


class CreateSession(RequestBody):
    prompt: Prompt = ""
    on_disconnect: OnDisconnect = Field("discard", description=_ON_DISCONNECT)
    ttl_seconds: int | None = Field(
        None,
        ge=1,
        description="idle seconds before the session expires (sliding)",
        json_schema_extra={"x-limit": "max_session_ttl"},
    )
    keep_versions: int | None = Field(
        None,
        ge=1,
        description="how many versions stay readable (fork or roll back to them), the current one included; "
        "default: the server's history_versions, at most its max_history_versions",
        json_schema_extra={"x-limit": "max_history_versions"},
    )


class RollbackTo(RequestBody):
    version: int = Field(ge=0, description="a version the session still keeps (GET .../versions)")


class ForkAt(RequestBody):
    version: int | None = Field(None, ge=0, description="fork the state as it was at this kept version")


class VersionInfo(ResponseBody):
    version: int
    n_tokens: int
    committed_at: datetime


class VersionList(ResponseBody):
    session_id: str
    version: int = Field(description="the current version")
    versions: list[VersionInfo] = Field(description="the versions kept, oldest first")


class TranscriptSegment(ResponseBody):
    session_id: str = Field(
        description="the session that committed it (a fork's first ones are its parent's)"
    )
    version: int = Field(description="the version that commit made")
    kind: Literal["create", "generate", "score", "keep", "rollback", "import", "fork"]
    start: int = Field(description="the token position where its ids begin")
    ids: list[int] = Field(description="the tokens the state consumed in this commit")
    text: str
    texts: list[str] = Field(
        description="each token's text as a stream shows it (a multi-byte character comes with the token "
        "that completes it); they join to `text`"
    )
    sampled: list[bool] = Field(description="the action mask: true where the model sampled the token")
    logprobs: list[float | None] = Field(
        description="behaviour log-prob of each sampled token; null for prompt"
    )
    sampling: dict | None = Field(description="the request's sampling parameters (generate, keep)")
    seed: int | None
    finish_reason: str | None
    committed_at: datetime
    restores: int | None = Field(description="a rollback: the version it made current again")


class SessionMessage(ResponseBody):
    role: str = Field(description="as the chat template names it: system, user, assistant, ...")
    content: str
    version: int = Field(description="the version whose commit consumed it")


class SessionMessages(ResponseBody):
    session_id: str
    version: int
    complete: bool = Field(
        description="false when part of what the state consumed is no chat turn the template reads back "
        "(a raw continuation, a score), or older history is not kept: the transcript shows it all"
    )
    messages: list[SessionMessage] = Field(description="in the order the state consumed them")


class Transcript(ResponseBody):
    session_id: str
    version: int
    n_tokens: int
    complete: bool = Field(
        description="false when the segments do not reach back to the session's first token (older ones "
        "dropped past the size bound, or the session was imported)"
    )
    segments: list[TranscriptSegment]


class SessionRef(ResponseBody):
    id: str
    version: int = Field(description="rises by one with every committed change")
    n_tokens: int = Field(description="tokens consumed by the session's state (BOS included)")


class SessionInfo(SessionRef):
    model: str
    created_at: datetime
    expires_at: datetime


class SessionDetail(SessionInfo):
    state_bytes: int = Field(description="size of the stored state (its snapshot and deltas)")
    history_bytes: int = Field(
        description="size of the kept past versions and the transcript (the key's quota counts both)"
    )


class ListedSession(SessionInfo):
    ephemeral: bool = Field(
        description="made for one request (a stateless completion's session, an `n` choice's fork): "
        "listed only with `ephemeral=true`"
    )
    preview: str = Field(
        description="a chat's first user message (as the served model's chat template reads it back), "
        "else the start of the text the session consumed; at most 80 characters; empty for a session of "
        "another model (this server's tokenizer cannot read its tokens)"
    )


class SessionList(ResponseBody):
    sessions: list[ListedSession] = Field(description="newest first")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null when there is none")


# -- sampling -------------------------------------------------------------------------------
# OpenAI's logit_bias: a JSON object from token ids (its keys are strings) to -100..100
# (its keys are token ids of the vocabulary: a served bound, as `TokenId` is)
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$", json_schema_extra={"x-limit": "vocab"})]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]]


class SamplingFields(RequestBody):
    """The sampling controls of every route that generates (the session generate route and
    both OpenAI routes), by vLLM's and OpenAI's names; `deps.sampling_params` maps them to
    `model.sampling.SamplingParams`, whose docstring defines each exactly. null (or absent)
    is a control's neutral value. Bounds that depend on the model or the request (token ids
    in the vocabulary, min_tokens within max_tokens) are checked there (422)."""

    temperature: float | None = Field(
        None, ge=0, description="0 = greedy; left out: the model's recommendation (GET /v1/models), else 1"
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="1 = off; left out: the model's recommendation, else off"
    )
    top_k: int | None = Field(
        None, ge=0, description="0 = off; left out: the model's recommendation, else off"
    )
    min_p: float | None = Field(
        None, ge=0, le=1, description="drop tokens less probable than min_p times the most probable; 0 = off"
    )
    repetition_penalty: float | None = Field(
        None,
        ge=0.01,
        le=100,
        description="vLLM/HF: the logit of a token in the request's prompt or output so far is divided by it "
        "(multiplied, if negative); 1 = off",
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="OpenAI: subtracted from the logit of a token in the request's output"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="OpenAI: times the token's count in the request's output, subtracted"
    )
    logit_bias: LogitBias | None = Field(
        None, max_length=1024, description="OpenAI: token id -> bias added to its logit"
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=64, description="vLLM: generation ends after any of these (finish_reason stop)"
    )
    ignore_eos: bool = Field(False, description="vLLM: EOS does not end the generation")
    min_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS_CEILING,
        description="vLLM: EOS and stop_token_ids cannot be sampled, nor stop strings end it, before this "
        "many tokens (past max_tokens: until max_tokens)",
    )


# -- generate -------------------------------------------------------------------------------
class Generate(SamplingFields):
    prompt: Prompt = ""
    max_tokens: int = Field(
        64, ge=1, le=MAX_TOKENS_CEILING, description="capped by the server's max_tokens setting"
    )
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="makes sampling reproducible")
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=16,
        description="generation ends after the token that completes any of these strings (it is kept)",
    )
    stream: bool = True
    logprobs: bool = False
    top_logprobs: int = Field(
        0,
        ge=0,
        le=20,
        description="each token also lists this many most probable tokens, under the distribution it was "
        "drawn from (and its logprob: implies logprobs)",
    )
    on_disconnect: OnDisconnect = Field(
        "discard",
        description="a streamed generation whose client hangs up: `discard` commits nothing; `commit` "
        "commits exactly the tokens sent before the hang-up (fenced, as any commit)",
    )


class GenerateQuery(BaseModel):
    """`GET .../generate` (for EventSource): Generate's fields as query parameters; always streams."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str = ""
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS_CEILING)
    temperature: float | None = Field(None, ge=0)  # (left out: as Generate's)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16
    )
    logprobs: bool = False
    on_disconnect: OnDisconnect = "discard"
    access_token: str | None = Field(
        None, description="the API key, for clients that cannot send headers (EventSource)"
    )


class TopLogprob(ResponseBody):
    id: int
    text: str
    logprob: float


class GeneratedToken(ResponseBody):
    index: int
    id: int
    text: str
    logprob: float | None = Field(None, description="behaviour log-prob, when logprobs=true")
    top_logprobs: list[TopLogprob] | None = Field(
        default=None,
        description="with top_logprobs: the most probable tokens it could draw, most probable first",
    )


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int


class GenerateDone(ResponseBody):
    text: str
    finish_reason: Literal["length", "stop", "eos"]
    usage: Usage
    session: SessionRef


class GenerateResult(GenerateDone):
    tokens: list[GeneratedToken]


# -- score ----------------------------------------------------------------------------------
class Score(RequestBody):
    prompt: Prompt
    commit: bool = False
    on_disconnect: OnDisconnect = Field("discard", description=_ON_DISCONNECT)


class ScoredToken(ResponseBody):
    id: int
    text: str
    logprob: float | None = Field(description="log p(token | everything before it); null with no context")


class ScoreResult(ResponseBody):
    tokens: list[ScoredToken]
    total_logprob: float
    session: SessionRef


# -- tokens (vLLM's /tokenize and /detokenize) ---------------------------------------------
class Tokenize(RequestBody):
    model: str | None = Field(None, description="the served model's name, if given")
    prompt: str
    add_special_tokens: bool = Field(True, description="prepend BOS, as a new session's state does")


class TokenizeResult(ResponseBody):
    count: int
    max_model_len: int = Field(
        description="the longest prompt one request may send (RECUR_MAX_PROMPT_TOKENS)"
    )
    tokens: list[int]


class Detokenize(RequestBody):
    model: str | None = Field(None, description="the served model's name, if given")
    tokens: list[TokenId] = Field(max_length=1 << 16)


class DetokenizeResult(ResponseBody):
    prompt: str


# -- health ---------------------------------------------------------------------------------
class Health(ResponseBody):
    status: Literal["ok"]


class Ready(ResponseBody):
    status: Literal["ready"]
    model: str
    fingerprint: str
    storage_full: bool = Field(
        description="Redis is near its maxmemory: new sessions and growing commits get 507 storage_full"
    )


# -- quotas ---------------------------------------------------------------------------------
class Limits(ResponseBody):
    sessions: int = Field(description="most live sessions")
    state_bytes: int = Field(description="most stored state, in bytes")
    requests_per_second: float = Field(description="request rate, shared by every replica (0 = no limit)")
    tokens_per_second: float = Field(description="generated tokens per second (0 = no limit)")


class Held(ResponseBody):
    count: int = Field(description="how many the key holds")
    bytes: int = Field(description="the bytes they hold in Redis, as the key's byte quota counts them")


class HeldByKind(ResponseBody):
    sessions: Held = Field(
        description="sessions: each its whole state (its snapshot and deltas, even where a fork shares its "
        "source's pages), its kept versions and its transcript"
    )
    responses: Held = Field(
        description="stored responses: each its record and a background response's events"
    )
    conversations: Held = Field(description="conversations: each its record and its items")


class TenantUsage(ResponseBody):
    tenant: str = Field(description="the key's id: 96 bits of its hash, never the key (`open` without keys)")
    sessions: int = Field(
        description="what the key holds against its session limit: its live sessions, stored responses and "
        "conversations (`held` splits them)"
    )
    state_bytes: int = Field(description="the bytes they hold, against its byte quota (`held` splits them)")
    held: HeldByKind
    limits: Limits
