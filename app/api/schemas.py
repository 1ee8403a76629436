"""Every request and response body of the HTTP API (pydantic), in one module.

Request models are strict: unknown fields, wrong types, NaN and infinities are rejected
(422). Limits that depend on the served model or the settings (vocabulary, prompt length,
max_tokens cap) are checked by the routers, which know them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from .error_types import ErrorType

# A request may ask for more tokens than the server's max_tokens setting (it is capped),
# but not for an absurd number: past this ceiling the body is invalid (422).
MAX_TOKENS_CEILING = 2**20
# Seeds stay within the integers JSON represents exactly everywhere (I-JSON, RFC 7493):
# past 2**53 a client, or a schema validator, that reads numbers as doubles rounds them
SEED_LIMIT = 2**53
MAX_CHOICES = 16  # `n` of the OpenAI routes: each choice is a fork and a generation

# A bound that depends on the served model or the settings is marked `x-limit` in the JSON
# schema (the setting's name, or `vocab`): app/api/openapi.py writes the served value into
# the OpenAPI document as its `maximum`; the routers enforce it (422).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-limit": "vocab"})]

Prompt = Annotated[
    str | list[TokenId],
    Field(description="text, or token ids of the served model's vocabulary"),
]


def _integral_floats(value: Any) -> Any:
    """`value` with every float that has no fractional part made an int, in dicts and lists."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats(v) for v in value]
    return value


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: Any) -> Any:
        # JSON has one number type, and JSON Schema's `integer` is any number without a
        # fractional part, 1938.0 too; strict mode would refuse it where an int is expected
        return _integral_floats(data)


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------------
class ErrorDetail(Response):
    type: ErrorType
    message: str


class ErrorBody(Response):
    error: ErrorDetail


# -- sessions -------------------------------------------------------------------------------
class CreateSession(Request):
    prompt: Prompt = ""
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


class RollbackTo(Request):
    version: int = Field(ge=0, description="a version the session still keeps (GET .../versions)")


class ForkAt(Request):
    version: int | None = Field(None, ge=0, description="fork the state as it was at this kept version")


class VersionInfo(Response):
    version: int
    n_tokens: int
    committed_at: datetime


class VersionList(Response):
    session_id: str
    version: int = Field(description="the current version")
    versions: list[VersionInfo] = Field(description="the versions kept, oldest first")


class TranscriptSegment(Response):
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


class Transcript(Response):
    session_id: str
    version: int
    n_tokens: int
    complete: bool = Field(
        description="false when the segments do not reach back to the session's first token (older ones "
        "dropped past the size bound, or the session was imported)"
    )
    segments: list[TranscriptSegment]


class SessionRef(Response):
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


class SessionList(Response):
    sessions: list[SessionInfo]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null when there is none")


# -- sampling -------------------------------------------------------------------------------
# OpenAI's logit_bias: a JSON object from token ids (its keys are strings) to -100..100
# (its keys are token ids of the vocabulary: a served bound, as `TokenId` is)
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$", json_schema_extra={"x-limit": "vocab"})]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]]


class SamplingFields(Request):
    """The sampling controls of every route that generates (the session generate route and
    both OpenAI routes), by vLLM's and OpenAI's names; `deps.sampling_params` maps them to
    `model.sampling.SamplingParams`, whose docstring defines each exactly. null (or absent)
    is a control's neutral value. Bounds that depend on the model or the request (token ids
    in the vocabulary, min_tokens within max_tokens) are checked there (422)."""

    temperature: float | None = Field(None, ge=0, description="default 1; 0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1, description="1 = off")
    top_k: int | None = Field(None, ge=0, description="0 = off")
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
    # the session route's own defaults, as before the other controls came (null is refused)
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="1 = off")
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
    on_disconnect: Literal["discard", "commit"] = Field(
        "discard",
        description="a streamed generation whose client hangs up: `discard` commits nothing; `commit` "
        "commits exactly the tokens sent before the hang-up (fenced, as any commit)",
    )


class GenerateQuery(BaseModel):
    """`GET .../generate` (for EventSource): Generate's fields as query parameters; always streams."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str = ""
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS_CEILING)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16
    )
    logprobs: bool = False
    on_disconnect: Literal["discard", "commit"] = "discard"
    access_token: str | None = Field(
        None, description="the API key, for clients that cannot send headers (EventSource)"
    )


class TopLogprob(Response):
    id: int
    text: str
    logprob: float


class GeneratedToken(Response):
    index: int
    id: int
    text: str
    logprob: float | None = Field(None, description="behaviour log-prob, when logprobs=true")
    top_logprobs: list[TopLogprob] | None = Field(
        default=None,
        description="with top_logprobs: the most probable tokens it could draw, most probable first",
    )


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int


class GenerateDone(Response):
    text: str
    finish_reason: Literal["length", "stop", "eos"]
    usage: Usage
    session: SessionRef


class GenerateResult(GenerateDone):
    tokens: list[GeneratedToken]


# -- score ----------------------------------------------------------------------------------
class Score(Request):
    prompt: Prompt
    commit: bool = False


class ScoredToken(Response):
    id: int
    text: str
    logprob: float | None = Field(description="log p(token | everything before it); null with no context")


class ScoreResult(Response):
    tokens: list[ScoredToken]
    total_logprob: float
    session: SessionRef


# -- OpenAI-compatible completions ----------------------------------------------------------
class StreamOptions(Request):
    include_usage: bool = False


StopString = Annotated[str, Field(min_length=1, max_length=256)]


class OpenAIBody(SamplingFields):
    """What the bodies of both OpenAI routes take: the model, sampling, stop strings,
    streaming and recur's `session_id` (and `top_k`). Fields OpenAI has but recur cannot
    honour are accepted only at their neutral values."""

    model: str | None = Field(None, description="the served model's name (see GET /v1/models)")
    n: int | None = Field(
        None,
        ge=1,
        le=MAX_CHOICES,
        description="choices per prompt: the first continues the prompt's session, the others forks of it "
        "(each choice's `session` says which); with `seed` s, choice j samples with seed s + j; n times the "
        "prompts at most the server's max_batch_size",
    )
    # (the bounds on each form: a Field's max_length would bound a string's characters and
    # an array's items alike, and the document would show only the first)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = Field(
        None,
        description="generation ends after the token that completes one; it is left out of the returned text "
        "unless include_stop_str_in_output (the session's state has consumed it either way)",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    user: str | None = Field(None, max_length=256, description="logged, not used")
    include_stop_str_in_output: bool = Field(
        False, description="vLLM: keep the stop string (or stop token) that ended the generation in the text"
    )
    session_id: str | None = Field(
        None, description="continue this session (or send X-Session-Id); absent: a new session is created"
    )


class Completion(OpenAIBody):
    """OpenAI's `POST /v1/completions` body (and what `OpenAIBody` adds)."""

    # the one combination the route refuses (422), stated so that no client (nor a fuzzer)
    # takes it for valid: echo with logprobs (a number) is not streamed
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "required": ["echo", "logprobs", "stream"],
                "properties": {
                    "echo": {"const": True},
                    "logprobs": {"type": "integer"},
                    "stream": {"const": True},
                },
            }
        }
    )

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        "",
        description="text, token ids, or an array of either: a batch, one choice per prompt (`index` "
        "in order), each in a new session; at most the server's max_batch_size prompts",
    )
    max_tokens: int | None = Field(
        16,
        ge=0,
        le=MAX_TOKENS_CEILING,
        description="null: the server's max_tokens setting; 0: none (with echo and logprobs: score the prompt)",
    )
    best_of: int | None = Field(None, description="only 1", json_schema_extra={"enum": [1, None]})
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="the sampled tokens' log-probs (behaviour log-probs), each with this many most probable "
        "alternatives in top_logprobs",
    )
    echo: bool = Field(
        False,
        description="the prompt's text first, and with logprobs its tokens' log-probs (the model's own; null "
        "for a token with nothing before it)",
    )
    suffix: str | None = Field(None, description="only null", json_schema_extra={"maxLength": 0})

    @field_validator("best_of")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only 1 is supported: a recurrent session has one continuation")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


class CompletionLogprobs(Response):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null: an echoed token with nothing before it")
    top_logprobs: list[dict[str, float] | None] | None = Field(
        default=None,
        description="with logprobs > 0: per token, its most probable alternatives by text (most probable "
        "first; null where token_logprobs is)",
    )
    text_offset: list[int]


class CompletionChoice(Response):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    session: SessionRef | None = Field(
        default=None,
        description="the session this choice was generated in, after its commit (streamed: in its last chunk)",
    )


class PromptTokensDetails(Response):
    cached_tokens: int = Field(
        0, description="prompt tokens a stateless request did not prefill: its key's committed prefix held them"
    )


class CompletionUsage(Response):
    prompt_tokens: int = Field(description="the request's whole prompt, cached tokens included")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class OpenAIResult(Response):
    """What every body and chunk of both OpenAI routes carries."""

    id: str
    created: int
    model: str
    system_fingerprint: str = Field(description="the served model's fingerprint")
    session_id: str = Field(
        description="the session generated in (also the X-Session-Id header); with several choices, the first's"
    )
    session: SessionRef | None = Field(
        None, description="the (first choice's) session after the commit (streamed: in its last chunk)"
    )


class CompletionResult(OpenAIResult):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage | None


# -- OpenAI-compatible chat completions -----------------------------------------------------
class ChatTextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    """One message of a conversation as OpenAI's clients send it: text only (no tools,
    images or audio)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatTextPart] = Field(description="text, or text parts (joined by newlines, as vLLM does)")
    name: str | None = Field(
        None, min_length=1, max_length=64, description="the speaker (the play-script template's name for them)"
    )


class ChatCompletion(OpenAIBody):
    """OpenAI's `POST /v1/chat/completions` body (and what `OpenAIBody` adds). By default
    generation stops at the chat template's turn stop, left out of the message."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="the conversation; continuing a session, only the new messages"
    )
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_CEILING, description="null: the server's max_tokens setting"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_CEILING, description="OpenAI's newer name for max_tokens; wins over it"
    )
    logprobs: bool = Field(False, description="the sampled tokens' log-probs, in choices[].logprobs.content")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="each token's most probable alternatives, this many, under the distribution it was drawn "
        "from (and its logprob: implies logprobs)",
    )
    chat_template_kwargs: dict[str, str | int | float | bool] | None = Field(
        None,
        description="vLLM's: variables for the chat template, e.g. the play-script's user_name and assistant_name",
    )


class ChatTopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's text as UTF-8")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(Response):
    content: list[ChatTokenLogprob] | None


class ChatReply(Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Response):
    index: int = 0
    message: ChatReply
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    session: SessionRef | None = Field(
        default=None, description="the session this choice was generated in, after its commit"
    )


class ChatCompletionResult(OpenAIResult):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChatDelta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # as OpenAI's: the role in the first delta only, no content in the last (`{}`)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    session: SessionRef | None = Field(
        default=None, description="the choice's session after its commit (in its last chunk)"
    )


class ChatCompletionChunk(OpenAIResult):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = Field(None, description="in the last chunk, with stream_options.include_usage")


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "recur"
    family: str = Field(description="the model family (transformer-xl, rlt, mamba, mamba2)")
    vocab_size: int
    context_window: int = Field(
        description="tokens a position attends over directly (Transformer-XL: mem_len + 1; RLT: "
        "max_context; Mamba, Mamba-2: d_conv, the convolution's reach); a session has no length limit: "
        "older context lives on in its recurrent state"
    )
    precision: str = Field(
        description="the compute precision the server runs: fp32, or bf16 (autocast); the behaviour log-probs it "
        "records come from it, so `recur replay --precision auto` replays in it"
    )


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- tokens (vLLM's /tokenize and /detokenize) ---------------------------------------------
class Tokenize(Request):
    model: str | None = Field(None, description="the served model's name, if given")
    prompt: str
    add_special_tokens: bool = Field(True, description="prepend BOS, as a new session's state does")


class TokenizeResult(Response):
    count: int
    max_model_len: int = Field(
        description="the longest prompt one request may send (RECUR_MAX_PROMPT_TOKENS)"
    )
    tokens: list[int]


class Detokenize(Request):
    model: str | None = Field(None, description="the served model's name, if given")
    tokens: list[TokenId] = Field(max_length=1 << 16)


class DetokenizeResult(Response):
    prompt: str


# -- health ---------------------------------------------------------------------------------
class Health(Response):
    status: Literal["ok"]


class Ready(Response):
    status: Literal["ready"]
    model: str
    fingerprint: str
    storage_full: bool = Field(
        description="Redis is near its maxmemory: new sessions and growing commits get 507 storage_full"
    )


# -- quotas ---------------------------------------------------------------------------------
class Limits(Response):
    sessions: int = Field(description="most live sessions")
    state_bytes: int = Field(description="most stored state, in bytes")
    requests_per_second: float = Field(description="request rate, shared by every replica (0 = no limit)")
    tokens_per_second: float = Field(description="generated tokens per second (0 = no limit)")


class TenantUsage(Response):
    tenant: str = Field(description="the key's id: 96 bits of its hash, never the key (`open` without keys)")
    sessions: int = Field(description="live sessions the key holds")
    state_bytes: int = Field(description="stored state bytes its sessions hold")
    limits: Limits
