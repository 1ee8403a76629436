"""The engine: scheduler, executor thread and batch. The only part of `app/` that touches
tensors or the model; it never builds an HTTP response."""

from .engine import Consumed, Engine
from .requests import EmptyContext, EngineError, Finished, Generation, TokenEvent

__all__ = ["Consumed", "EmptyContext", "Engine", "EngineError", "Finished", "Generation", "TokenEvent"]
