"""The engine: the scheduler, the runner and the thread that runs them. The only part of
`app/` that touches tensors or the model; it imports only `model/` and never builds an
HTTP response or speaks to Redis."""

from .engine import Engine
from .fairness import Fairness
from .requests import (
    Alternatives,
    EmptyContext,
    EngineError,
    Finished,
    FinishReason,
    Logprobs,
    ModelFailed,
    NonFinite,
    QueueFull,
    Request,
    Stored,
    TokenEvent,
)
from .watchdog import EngineStalled

__all__ = [
    "Alternatives",
    "EmptyContext",
    "Engine",
    "Fairness",
    "EngineError",
    "EngineStalled",
    "Finished",
    "FinishReason",
    "Logprobs",
    "ModelFailed",
    "NonFinite",
    "QueueFull",
    "Request",
    "Stored",
    "TokenEvent",
]
