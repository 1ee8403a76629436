"""The bodies of the Responses and Conversations APIs (`/v1/responses`, `/v1/conversations`),
as OpenAI's API names them. Requests are strict as every request body (app/api/schemas.py); the
fields OpenAI has that recur does not implement are accepted where harmless, and refused
with 400 `unsupported` naming the field where not (responses.py `unsupported`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from ..schemas import MAX_TOKENS_CEILING, SEED_LIMIT, RequestBody, ResponseBody, SamplingFields

Text = Annotated[str, Field(max_length=1_000_000)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]
LOGPROBS = "message.output_text.logprobs"


# -- requests -------------------------------------------------------------------------------
class InputText(RequestBody):
    type: Literal["input_text"]
    text: Text


class OutputTextIn(RequestBody):
    """An assistant's text, as a client sends a reply back (its annotations and log-probs ignored)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(RequestBody):
    """A message item: `user`, `system`, `developer` or `assistant`, its content a string or
    text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputText | OutputTextIn], Field(max_length=256)]
    id: Annotated[str, Field(max_length=128)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallIn(RequestBody):
    """A call a response made (`function_call`), as a client sends it back."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    arguments: Text
    id: Annotated[str, Field(max_length=128)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputIn(RequestBody):
    """A call's result (`function_call_output`): text, or text parts."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(max_length=256)]
    output: Text | Annotated[list[InputText | OutputTextIn], Field(max_length=256)]
    id: Annotated[str, Field(max_length=128)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = InputMessage | FunctionCallIn | FunctionCallOutputIn
Input = Text | Annotated[list[InputItem], Field(max_length=1024)]


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text; json_object (any JSON object); json_schema (JSON valid against `schema`): a grammar "
        "makes the answer so"
    )
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(RequestBody):
    id: Annotated[str, Field(max_length=128)]


SET = {"not": {"type": "null"}}  # a field sent, not null


def _never(**values: Any) -> dict[str, Any]:
    """A body with all of these fields at these values (JSON Schema) is not valid."""
    return {"not": {"required": list(values), "properties": values}}


# the combinations responses.py `unsupported` refuses
REFUSED: list[Any] = [
    _never(conversation=SET, previous_response_id=SET),
    _never(conversation=SET, store={"const": False}),
    _never(background={"const": True}, store={"const": False}),
]


class ResponseCreate(SamplingFields):
    """OpenAI's `POST /v1/responses` body (recur adds vLLM's sampling fields and `seed`).

    What recur refuses (400 `unsupported`, responses.py) the schema states too, so that no
    client (nor a fuzzer) takes it for valid: a field's other values (`tools` with entries,
    another `include`, ...), and the combinations below: `conversation` with
    `previous_response_id`; `background: true` or `conversation` with `store: false`.
    Function tools are served (`tools` of type `function`); hosted tools are not."""

    model_config = ConfigDict(json_schema_extra={"allOf": REFUSED})

    model: str | None = Field(None, description="the served model's name (see GET /v1/models)")
    input: Input = Field("", description="a string (a user message), or message items")
    instructions: Text | None = Field(None, description="a system message first, for this response only")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CEILING)
    previous_response_id: Annotated[str, Field(max_length=128)] | None = Field(
        None, description="continue the state that response committed; only the new input is prefilled"
    )
    conversation: Annotated[str, Field(max_length=128)] | ConversationRef | None = Field(
        None, description="append to this conversation (not with previous_response_id)"
    )
    store: bool | None = Field(True, description="keep the response (and its state) for response_retention")
    background: bool | None = Field(False, description="run detached: answered at once, `queued`")
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(None, description="accepted, ignored")
    include: (
        Annotated[
            list[Annotated[str, Field(max_length=128, json_schema_extra={"enum": [LOGPROBS]})]],
            Field(max_length=16),
        ]
        | None
    ) = Field(None, description=f"only `{LOGPROBS}`")
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: Metadata | None = None
    user: Annotated[str, Field(max_length=256)] | None = Field(None, description="logged, not used")
    safety_identifier: Annotated[str, Field(max_length=256)] | None = Field(None, description="ignored")
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = Field(None, description="ignored")
    service_tier: Annotated[str, Field(max_length=32)] | None = Field(None, description="ignored")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    max_tool_calls: int | None = Field(None, ge=0, description="accepted, ignored")
    tools: Annotated[list[FunctionTool | dict[str, Any]], Field(max_length=128)] | None = Field(
        None, description="function tools (hosted tools are refused: 400)"
    )
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = Field(
        None,
        description="auto (the default): text or calls; required: calls (grammar-constrained); a named "
        "function: a call of it; none: text, the tools not shown",
    )
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = Field(
        None, description="only nulls: 400", json_schema_extra={"additionalProperties": {"type": "null"}}
    )
    prompt: dict[str, Any] | None = Field(
        None, description="only null: 400", json_schema_extra={"type": "null"}
    )
    truncation: Literal["auto", "disabled"] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="recur: the sampler's seed")


class ItemsCreate(RequestBody):
    items: Annotated[list[InputItem], Field(max_length=1024)]


class ConversationCreate(RequestBody):
    items: Annotated[list[InputItem], Field(max_length=1024)] | None = None
    metadata: Metadata | None = None


class ConversationUpdate(RequestBody):
    metadata: Metadata


# -- responses ------------------------------------------------------------------------------
class TopLogprob(ResponseBody):
    # another model shares this name (schemas.TopLogprob), so the OpenAPI document names
    # both by their modules: this one keeps the name it was published under before the
    # move into openai/ (renaming it is a change of the document, not of a file)
    __module__ = "app.api.responses_schemas"

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class OutputText(ResponseBody):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] | None = None


class ContentText(ResponseBody):
    type: Literal["input_text", "output_text"]
    text: str


class OutputMessage(ResponseBody):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOut(ResponseBody):
    """A call a response made: its `arguments` are JSON text."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOutputOut(ResponseBody):
    type: Literal["function_call_output"]
    id: str
    call_id: str
    output: str | list[ContentText | OutputText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(ResponseBody):
    """A stored message item (a response's input, or a conversation's)."""

    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentText | OutputText]


Item = MessageItem | FunctionCallOut | FunctionCallOutputOut


class InputTokensDetails(ResponseBody):
    cached_tokens: int = Field(
        description="the input's tokens the starting state already held: not prefilled"
    )


class OutputTokensDetails(ResponseBody):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseBody):
    input_tokens: int = Field(description="the whole input's tokens, the reused part included")
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(ResponseBody):
    code: str
    message: str


class IncompleteDetails(ResponseBody):
    reason: Literal["max_output_tokens"]


class TextOut(ResponseBody):
    format: dict[str, Any]


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
Output = list[OutputMessage | FunctionCallOut]


class ResponseObject(ResponseBody):
    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
    model: str
    output: Output
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    conversation: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    text: TextOut
    truncation: str
    background: bool
    store: bool
    user: str | None = None
    reasoning: None = None


class StreamEvent(ResponseBody):
    """One event of a response's stream; `type` says which of the fields it has."""

    type: Literal[
        "response.created", "response.queued", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
        "response.incomplete", "response.failed", "error", "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ]  # fmt: skip
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputMessage | FunctionCallOut | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = Field(None, description="response.function_call_arguments.done: the call's whole")
    name: str | None = None
    logprobs: list[TokenLogprob] | None = None
    # `error`, the last event of a cancelled response (code `cancelled`) or of a replay that
    # failed once begun (code: the error's type)
    code: str | None = None
    message: str | None = None
    param: str | None = None


class Deleted(ResponseBody):
    id: str
    object: Literal["response.deleted", "conversation.deleted", "conversation.item.deleted"]
    deleted: Literal[True]


class ItemList(ResponseBody):
    object: Literal["list"]
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ConversationObject(ResponseBody):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]
