"""recur's model library: recurrent-memory language model families and their state.

    import model
    lm = model.load("shakespeare", device="cpu")
    st = lm.new_state(batch_size=2)
    logits, st = lm.forward(tokens, st)   # LongTensor [B, T] -> logits [B, T, V]
    blob = st.to_bytes(); st2 = lm.load_state(blob)

This package knows nothing of HTTP, Redis or asyncio.
"""

from .checkpoint import init, load, shipped
from .family import FUNCTIONAL, IN_PLACE, ContextFull, Execution, LanguageModel, Step, compiled_in_place
from .native import build, fingerprint, save
from .state import State, StateError
from .tokenizer import ByteTokenizer

__all__ = [
    "FUNCTIONAL",
    "IN_PLACE",
    "ByteTokenizer",
    "ContextFull",
    "Execution",
    "LanguageModel",
    "State",
    "StateError",
    "Step",
    "build",
    "compiled_in_place",
    "fingerprint",
    "init",
    "load",
    "save",
    "shipped",
]
