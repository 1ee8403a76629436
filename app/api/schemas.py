"""Every request and response body of the HTTP API (pydantic), in one module.

Request models are strict: unknown fields, wrong types, NaN and infinities are rejected
(422). Limits that depend on the served model or the settings (vocabulary, prompt length,
max_tokens cap) are checked by the routers, which know them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ErrorType

Prompt = Annotated[
    str | list[int],
    Field(description="text, or token ids of the served model's vocabulary"),
]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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
        None, ge=1, description="idle seconds before the session expires (sliding)"
    )


class SessionRef(Response):
    id: str
    version: int = Field(description="rises by one with every committed change")
    n_tokens: int = Field(description="tokens consumed by the session's state (BOS included)")


class SessionInfo(SessionRef):
    model: str
    created_at: datetime
    expires_at: datetime


class SessionDetail(SessionInfo):
    state_bytes: int = Field(description="size of the stored state blob")


# -- generate -------------------------------------------------------------------------------
class Generate(Request):
    prompt: Prompt = ""
    max_tokens: int = Field(64, ge=1, description="capped by the server's max_tokens setting")
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="1 = off")
    seed: int | None = Field(None, ge=0, lt=2**63, description="makes sampling reproducible")
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=16,
        description="generation ends after the token that completes any of these strings (it is kept)",
    )
    stream: bool = True
    logprobs: bool = False


class GeneratedToken(Response):
    index: int
    id: int
    text: str
    logprob: float | None = Field(None, description="behaviour log-prob, when logprobs=true")


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


# -- health ---------------------------------------------------------------------------------
class Health(Response):
    status: Literal["ok"]


class Ready(Response):
    status: Literal["ready"]
    model: str
    fingerprint: str
