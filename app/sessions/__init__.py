"""The sessions service: a session's whole transaction, from its lock to its commit, the
hot cache and the persistence policy. A reader finds the whole life of a request here:

- service.py: the writes, step by step (lock, start, run, reserve, commit, settle), and
  the persistence policy; making.py: the writes that make a session (create, import, fork);
- reads.py: what every request shares (the starting state, running one engine request)
  and the requests that only read;
- run.py: a generation in progress, from its first token to its commit;
- choices.py: many generations of one request (OpenAI's `n`), and requests that name no
  session (prefix reuse);
- cache.py: the hot cache;
- starts.py, responses.py, conversations.py, background.py: the Responses and Conversations
  APIs' transactions (where a response starts; a response is a session version; a
  conversation is a session) and the background responses' workers, leases and sweep.

Tenant accounting (admission, quotas, settlement) is app/tenants.py's, called at a
transaction's start and end; Redis is app/store's; the model is app/engine's. This package
knows neither HTTP nor tensors.
"""

from __future__ import annotations

from .background import Background, Replay
from .cache import Held, HotCache
from .choices import Started, needs_whole_prompt, start_generations, stateless
from .conversations import Conversations
from .making import StateRejected
from .reads import Listed, Listing, ModelMismatch, SessionReads
from .responses import Begun, Responses
from .run import ClientDisconnected, Run
from .service import Generation, SessionService
from .starts import NotContinuable, Render, Turn

__all__ = [
    "Background",
    "Replay",
    "Begun",
    "ClientDisconnected",
    "Conversations",
    "NotContinuable",
    "Render",
    "Responses",
    "Turn",
    "Generation",
    "Held",
    "HotCache",
    "Listed",
    "Listing",
    "ModelMismatch",
    "Run",
    "SessionReads",
    "SessionService",
    "Started",
    "StateRejected",
    "needs_whole_prompt",
    "start_generations",
    "stateless",
]
