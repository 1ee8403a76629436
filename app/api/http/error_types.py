"""The one enum of error types: the `type` string of every error body (`{"error": {"type",
"message"}}`) and SSE `error` event.

Its own module so that both the schemas (which document the body) and the error handlers
(which map exceptions to it) can import it without importing each other. Values only:
the HTTP status of each type lives with the handlers, in `app/api/http/errors.py`.
"""

from __future__ import annotations

import enum


class ErrorType(str, enum.Enum):
    invalid_request = "invalid_request"
    # a reply's shape that cannot be had: a JSON schema or tool parameters no grammar can be
    # made of, a tool_choice naming no tool offered (400, as OpenAI answers them)
    invalid_schema = "invalid_schema"
    unauthorized = "unauthorized"
    forbidden = "forbidden"
    model_not_found = "model_not_found"
    no_chat_template = "no_chat_template"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    session_not_found = "session_not_found"
    object_not_found = "object_not_found"  # a response, conversation or item (Responses API)
    unsupported = "unsupported"  # a Responses API feature recur does not implement, by field
    session_busy = "session_busy"
    session_conflict = "session_conflict"
    model_mismatch = "model_mismatch"
    version_mismatch = "version_mismatch"
    version_gone = "version_gone"
    prompt_too_long = "prompt_too_long"
    body_too_large = "body_too_large"
    queue_full = "queue_full"
    quota_exceeded = "quota_exceeded"
    storage_full = "storage_full"
    state_corrupt = "state_corrupt"
    invalid_state = "invalid_state"
    redis_unavailable = "redis_unavailable"
    outcome_unknown = "outcome_unknown"  # a write Redis did not answer: it may have happened
    not_ready = "not_ready"
    engine_stalled = "engine_stalled"
    internal_error = "internal_error"
    client_disconnected = "client_disconnected"
