"""The engine: scheduler, executor thread and batch. The only part of `app/` that touches
tensors or the model; it never builds an HTTP response."""

from .cache import Held
from .engine import Consumed, Engine
from .requests import (
    Commit,
    EmptyContext,
    EngineError,
    Finished,
    Generation,
    QueueFull,
    StateSource,
    TokenEvent,
)

__all__ = [
    "Commit",
    "Consumed",
    "EmptyContext",
    "Engine",
    "EngineError",
    "Finished",
    "Generation",
    "Held",
    "QueueFull",
    "StateSource",
    "TokenEvent",
]
