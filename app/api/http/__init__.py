"""The HTTP plumbing every route shares: the ASGI middleware, the one exception -> status
mapping (`errors.py`, `error_types.py`), the dependencies and body checks (`deps.py`), SSE
framing (`sse.py`), the OpenAPI document's completion (`openapi.py`) and a client's
hangup (`disconnect.py`). It never imports a route."""
