"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the served model's token ids
of a text, and the text of token ids."""

from __future__ import annotations

from fastapi import APIRouter

from .deps import EngineDep, SettingsDep
from .errors import ApiError, ErrorType, responses
from .schemas import Detokenize, DetokenizeResult, Tokenize, TokenizeResult

router = APIRouter(tags=["tokens"])

_ERRORS = responses(
    ErrorType.invalid_request, ErrorType.model_not_found, ErrorType.unauthorized, ErrorType.quota_exceeded
)


def _check_model(asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise ApiError(
            ErrorType.model_not_found, f"model {asked!r} is not served here; this server runs {served!r}"
        )


@router.post("/tokenize", response_model=TokenizeResult, summary="A text's token ids", responses=_ERRORS)
async def tokenize(body: Tokenize, engine: EngineDep, settings: SettingsDep) -> TokenizeResult:
    _check_model(body.model, engine.name)
    ids = engine.tokenize(body.prompt)
    bos = engine.tokenizer.bos_id
    if body.add_special_tokens and bos is not None:
        ids = [bos, *ids]
    return TokenizeResult(count=len(ids), max_model_len=settings.max_prompt_tokens, tokens=ids)


@router.post(
    "/detokenize", response_model=DetokenizeResult, summary="The text of token ids", responses=_ERRORS
)
async def detokenize(body: Detokenize, engine: EngineDep) -> DetokenizeResult:
    _check_model(body.model, engine.name)
    bad = [i for i in body.tokens if not 0 <= i < engine.vocab_size]
    if bad:
        raise ApiError(
            ErrorType.invalid_request,
            f"token id {bad[0]} is outside the model's vocabulary [0, {engine.vocab_size})",
        )
    return DetokenizeResult(prompt=engine.tokenizer.decode(body.tokens))
