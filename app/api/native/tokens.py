"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the served model's token ids
of a text, and the text of token ids."""

from __future__ import annotations

from fastapi import APIRouter

from ..http.deps import EngineDep, SettingsDep, in_vocabulary, served_model
from ..http.errors import ErrorType, error_docs
from ..schemas import Detokenize, DetokenizeResult, Tokenize, TokenizeResult

router = APIRouter(tags=["tokens"])

_ERRORS = error_docs(ErrorType.invalid_request, ErrorType.model_not_found)


@router.post("/tokenize", response_model=TokenizeResult, summary="A text's token ids", responses=_ERRORS)
async def tokenize(body: Tokenize, engine: EngineDep, settings: SettingsDep) -> TokenizeResult:
    served_model(body.model, engine)
    ids = engine.tokenize(body.prompt)
    bos = engine.tokenizer.bos_id
    if body.add_special_tokens and bos is not None:
        ids = [bos, *ids]
    return TokenizeResult(count=len(ids), max_model_len=settings.max_prompt_tokens, tokens=ids)


@router.post(
    "/detokenize", response_model=DetokenizeResult, summary="The text of token ids", responses=_ERRORS
)
async def detokenize(body: Detokenize, engine: EngineDep) -> DetokenizeResult:
    served_model(body.model, engine)
    return DetokenizeResult(prompt=engine.tokenizer.decode(in_vocabulary(engine, body.tokens)))
