"""The bodies of the OpenAI-compatible routes (completions, chat completions, models), as
OpenAI's API names them; recur's additions (`session_id`, a choice's `session`, vLLM's
sampling fields) are marked in their descriptions. Strict as every request body
(app/api/schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from ..schemas import (
    MAX_CHOICES,
    MAX_TOKENS_CEILING,
    SEED_LIMIT,
    RequestBody,
    ResponseBody,
    SamplingFields,
    SessionRef,
    TokenId,
)


# -- OpenAI-compatible completions ----------------------------------------------------------
class StreamOptions(RequestBody):
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
        description="16 as OpenAI's; null: the model's recommended bound (GET /v1/models), else the server's "
        "max_tokens setting; 0: none (with echo and logprobs: score the prompt)",
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


class CompletionLogprobs(ResponseBody):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null: an echoed token with nothing before it")
    top_logprobs: list[dict[str, float] | None] | None = Field(
        default=None,
        description="with logprobs > 0: per token, its most probable alternatives by text (most probable "
        "first; null where token_logprobs is)",
    )
    text_offset: list[int]


class CompletionChoice(ResponseBody):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    session: SessionRef | None = Field(
        default=None,
        description="the session this choice was generated in, after its commit (streamed: in its last chunk)",
    )


class PromptTokensDetails(ResponseBody):
    cached_tokens: int = Field(
        0,
        description="prompt tokens a stateless request did not prefill: its key's committed prefix held them",
    )


class CompletionUsage(ResponseBody):
    prompt_tokens: int = Field(description="the request's whole prompt, cached tokens included")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class OpenAIResult(ResponseBody):
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
class ChatTextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatFunctionCall(RequestBody):
    name: str = Field(min_length=1, max_length=128)
    arguments: str = Field(max_length=1_000_000, description="the arguments as JSON text")


class ChatToolCall(RequestBody):
    """A call an assistant's message made (as a client sends the conversation back)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessage(RequestBody):
    """One message of a conversation as OpenAI's clients send it: text (no images or
    audio), an assistant's `tool_calls`, or a `tool` message with a call's result."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatTextPart] | None = Field(
        None,
        description="text, or text parts (joined by newlines, as vLLM does); null: an assistant's tool calls",
    )
    name: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="the speaker (the play-script template's name for them)",
    )
    tool_calls: Annotated[list[ChatToolCall], Field(max_length=128)] | None = Field(
        None, description="an assistant's: the calls it made"
    )
    tool_call_id: str | None = Field(
        None, max_length=256, description="a tool message's: the call it answers"
    )
    refusal: str | None = Field(None, description="ignored")


class FunctionDef(RequestBody):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(
        None,
        description="a constrained call's arguments follow the schema exactly (else keywords llguidance lacks are ignored)",
    )


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextResponseFormat(RequestBody):
    type: Literal["text"]


class JsonObjectResponseFormat(RequestBody):
    """Any JSON object (a grammar makes the answer one: llguidance)."""

    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestBody):
    """JSON valid against `json_schema.schema` (a grammar makes the answer so: llguidance)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class ChatCompletion(OpenAIBody):
    """OpenAI's `POST /v1/chat/completions` body (and what `OpenAIBody` adds). By default
    generation stops at the chat template's turn stop, left out of the message."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="the conversation; continuing a session, only the new messages"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS_CEILING,
        description="null: the model's recommended bound, else the server's max_tokens",
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
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = Field(
        None, description="functions the model may call, shown to it in its chat template's way"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools): text or calls; required: calls (grammar-constrained); "
        "a named function: a call of it; none: text, the tools not shown",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    response_format: ResponseFormat | None = None


class ChatTopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's text as UTF-8")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob] | None


class ChatFunctionCallOut(ResponseBody):
    name: str
    arguments: str


class ChatToolCallOut(ResponseBody):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCallOut


class ChatReply(ResponseBody):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ChatToolCallOut] | None = None


class ChatChoice(ResponseBody):
    index: int = 0
    message: ChatReply
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]
    session: SessionRef | None = Field(
        default=None, description="the session this choice was generated in, after its commit"
    )


class ChatCompletionResult(OpenAIResult):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChatFunctionDelta(ResponseBody):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatToolCallDelta(ResponseBody):
    """A piece of a streamed call: its first has the id, type and name, the rest argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChatFunctionDelta

    @model_serializer(mode="wrap")
    def _present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(ResponseBody):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # as OpenAI's: the role in the first delta only, no content in the last (`{}`)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ResponseBody):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    session: SessionRef | None = Field(
        default=None, description="the choice's session after its commit (in its last chunk)"
    )


class ChatCompletionChunk(OpenAIResult):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = Field(
        None, description="in the last chunk, with stream_options.include_usage"
    )


class SamplingDefaults(ResponseBody):
    """What a request gets for each control it leaves out: the checkpoint's recommendation
    (its generation_config.json, its GGUF metadata, or a packaged model's card). null: the
    control's neutral value (temperature 1, top_p 1, no top_k, min_p or penalty)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = Field(
        None, description="a reply's bound when its request names none (the server's max_tokens caps it)"
    )
    source: str = Field(description="where the values come from; `none` when the checkpoint recommends none")


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "recur"
    family: str = Field(description="the model family (transformer-xl, rlt, llama, mamba, mamba2)")
    vocab_size: int
    context_window: int | None = Field(
        description="tokens a position attends over directly (Transformer-XL: mem_len + 1; RLT: "
        "max_context; an LLM: sinks + window + 1; a hybrid: its attention layers' span); null for a pure "
        "recurrence (Mamba, Mamba-2), which attends over no tokens. Not a limit on a session's length, "
        "which has none: older context lives on in the recurrent state"
    )
    precision: str = Field(
        description="the compute precision the server runs: fp32, bf16 (autocast) or int8 (int8 weights); the "
        "behaviour log-probs it records come from it, so `recur replay --precision auto` replays in it"
    )
    chat_template: bool = Field(
        False, description="whether the model has a chat template, so that /v1/chat/completions serves it"
    )
    sampling_defaults: SamplingDefaults


class ModelList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[ModelCard]
