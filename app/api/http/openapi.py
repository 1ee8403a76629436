"""The OpenAPI document (`/openapi.json`), made to tell the truth: FastAPI's document of the
routes, plus what FastAPI cannot see in a route's signature.

- **Errors.** A route declares the error types it raises itself (`errors.responses`); this
  module adds what the layers around it answer: 500 on every route, 422 on a route with
  parameters or a body, 413 on one with a body, and the errors of each dependency the
  route runs (`RAISED_BY`: 401 behind `authenticate`, 412 with `If-Match`, ...). Every
  error status is the one error body, its `type` narrowed to the types that status carries
  on that route (errors.document).
- **Auth.** With API keys set, the routes behind `authenticate` require a bearer key (or
  `access_token` in the query, for EventSource), and so does `/metrics` with
  `metrics_access=api_key` (off, it is left out); an open server declares no security.
- **Served limits.** A schema field marked `x-limit` (app/api/schemas.py) gets the served value as
  its `maximum`: the vocabulary for token ids, a setting for the others.
- **Links** from each response that names a session to every operation on a session, so
  that a stateful client (schemathesis's stateful phase) can follow create -> generate ->
  fork -> rollback -> versions -> delete; a session's version travels along (If-Match,
  `?version=`, a rollback's body). Likewise from a Responses API response to its
  retrieve, delete, input items, cancel and a response continuing it, and from a
  conversation to its reads, update, delete and items.

It only describes: the behaviour it documents lives in errors.py, deps.py and the routers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.params import Depends
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.config import Settings

from .. import schemas
from ..openai import responses_schemas
from ..openai import schemas as openai_schemas
from . import deps, errors
from .error_types import ErrorType

# what each dependency can answer, whatever the route that runs it
RAISED_BY: dict[Callable[..., Any], tuple[ErrorType, ...]] = {
    deps.authenticate: (ErrorType.unauthorized,),
    deps.check_rate: (ErrorType.quota_exceeded, ErrorType.redis_unavailable),
    deps.get_sessions: (ErrorType.not_ready,),
    deps.if_match: (ErrorType.invalid_request, ErrorType.version_mismatch),
}
_COMPONENT = "#/components/schemas/"
_SCHEMAS = (schemas, openai_schemas, responses_schemas)
_SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "an API key: `Authorization: Bearer KEY`"},
    "access_token": {
        "type": "apiKey",
        "in": "query",
        "name": "access_token",
        "description": "the API key in the query string, for EventSource (which cannot send headers)",
    },
}

Routers = Sequence[tuple[APIRouter, Sequence[Depends]]]


def install(app: FastAPI, routers: Routers) -> None:
    """Serve the document built here. `routers`: each router with the dependencies it was
    included with. Built once the model is loaded (the vocabulary is a served limit)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=app.version,
            openapi_version=app.openapi_version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        services = app.state.services
        vocab = services.engine.vocab_size if services is not None else None
        complete_document(doc, routers, app.state.settings, vocab, keys=bool(app.state.api_keys))
        if vocab is not None:  # before the model is loaded, the token ids have no bound yet
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def complete_document(doc: dict, routers: Routers, settings: Settings, vocab: int | None, keys: bool) -> None:
    """Complete FastAPI's document `doc` in place."""
    for route, included in _routes(routers):
        calls = [d.dependency for d in included if d.dependency] + list(_calls(route.dependant))
        for method in route.methods or ():
            op = doc["paths"][route.path_format][method.lower()]
            _document_errors(op, calls, keys)
            for parameter in op.get("parameters", []):
                _never_null(parameter)
            for response in op["responses"].values():
                _no_empty_json(response)
            if keys and deps.authenticate in calls:
                op["security"] = [{name: []} for name in _SECURITY_SCHEMES]
    if settings.metrics_access == "off":  # GET /metrics answers 404, as if it were not there
        doc["paths"].pop("/metrics", None)
    _metrics_access(doc["paths"].get("/metrics", {}).get("get"), settings, keys)
    components = doc.setdefault("components", {})
    if keys:
        components["securitySchemes"] = _SECURITY_SCHEMES
    _add_missing_components(doc)
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, never sent here
        components.get("schemas", {}).pop(unused, None)
    _write_limits(doc, settings, vocab)
    _add_links(doc)


def _metrics_access(op: dict | None, settings: Settings, keys: bool) -> None:
    """`GET /metrics` checks its access itself, by a setting (app/api/native/metrics.py): with
    api_key it asks for a key when the server has keys."""
    if op is not None and settings.metrics_access == "api_key" and keys:
        errors.document(op["responses"], [ErrorType.unauthorized])
        op["security"] = [{name: []} for name in _SECURITY_SCHEMES]


def _routes(routers: Routers) -> Iterator[tuple[APIRoute, Sequence[Depends]]]:
    for router, included in routers:
        for route in router.routes:
            if isinstance(route, APIRoute) and route.include_in_schema:
                yield route, included


def _calls(dependant: Dependant) -> Iterator[Callable[..., Any]]:
    """Every dependency a route runs, however deep."""
    for sub in dependant.dependencies:
        if sub.call is not None:
            yield sub.call
        yield from _calls(sub)


def _document_errors(op: dict, calls: list[Callable[..., Any]], keys: bool) -> None:
    types = [ErrorType.internal_error, ErrorType.forbidden]  # (app/api/http/middleware.py's BrowserGuard)
    if op.get("parameters") or "requestBody" in op:
        types.append(ErrorType.invalid_request)
    if "requestBody" in op:
        types.append(ErrorType.body_too_large)  # app/api/http/middleware.py's BodyLimit
    for call in calls:
        types += RAISED_BY.get(call, ())
    if not keys:  # an open server never asks for a key
        types = [t for t in types if t is not ErrorType.unauthorized]
    errors.document(op["responses"], types)


def _never_null(parameter: dict) -> None:
    """An optional query or header parameter is absent or a value, never null: FastAPI's
    `anyOf: [X, null]` for `X | None` becomes X (else a client sends the text `null`)."""
    schema = parameter["schema"]
    branches = schema.get("anyOf", [])
    values = [b for b in branches if b.get("type") != "null"]
    if len(values) == 1 and len(branches) == 2:
        del schema["anyOf"]
        schema.update(values[0])


def _no_empty_json(response: dict) -> None:
    """Drop the `application/json: {schema: {}}` FastAPI writes for a route without a
    response model, when the response documents its real media type (an event stream)."""
    content = response.get("content", {})
    if len(content) > 1 and content.get("application/json") == {"schema": {}}:
        del content["application/json"]


def _add_missing_components(doc: dict) -> None:
    """Put into components every model of the schema modules that the document refers to and
    FastAPI left out (those only in `responses=` declarations: the error body, SSE data)."""
    components = doc["components"].setdefault("schemas", {})
    missing: list[type[BaseModel]] = []
    while names := {n for n in _refs(doc) if n not in components} - {m.__name__ for m in missing}:
        missing += [_model(name) for name in sorted(names)]
        _, defs = models_json_schema(
            [(m, "serialization") for m in missing], ref_template=_COMPONENT + "{model}"
        )
        for name, schema in defs.get("$defs", {}).items():
            components.setdefault(name, schema)


def _model(name: str) -> type[BaseModel]:
    """The model named `name` in one of the schema modules."""
    return next(getattr(m, name) for m in _SCHEMAS if hasattr(m, name))


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_COMPONENT):
            yield ref.removeprefix(_COMPONENT)
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _write_limits(node: Any, settings: Settings, vocab: int | None, key: bool = False) -> None:
    """Each `x-limit` marker becomes the served value's bound (and goes): the `maximum` of a
    number, the `pattern` of a string that holds one (`key`: a JSON object's keys, as
    logit_bias's token ids are)."""
    if isinstance(node, dict):
        limit = node.pop("x-limit", None)
        bound = (vocab - 1 if vocab is not None else None) if limit == "vocab" else None
        if limit is not None and limit != "vocab":
            bound = getattr(settings, limit)
        if bound is not None and (key or node.get("type") == "string"):
            node["pattern"] = f"^({range_pattern(bound)})$"
        elif bound is not None:
            node["maximum"] = bound
        for name, value in node.items():
            _write_limits(value, settings, vocab, key=name == "propertyNames")
    elif isinstance(node, list):
        for value in node:
            _write_limits(value, settings, vocab)


def range_pattern(maximum: int) -> str:
    """A regular expression for the decimal numbers 0..maximum, written without leading
    zeros: the shorter ones, then per digit of `maximum` the numbers that share its digits
    so far and are lower at that one, then `maximum` itself."""
    top = str(maximum)
    parts = ["0"] if maximum > 0 else []
    parts += ["[1-9]" + "[0-9]" * (n - 1) for n in range(1, len(top))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) - 1 >= low:
            parts.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + "[0-9]" * (len(top) - i - 1))
    parts.append(top)
    return "|".join(parts)


def _add_links(doc: dict) -> None:
    """Links from every response that names a session (one with `id` and `version`: a new,
    read or rolled-back session's; a completion's: `session_id`) to every operation on
    `/v1/sessions/{session_id}...`; and from a response or a conversation object to every
    operation on it (`{response_id}`, `{conversation_id}`), and from a response to the
    response that continues it."""
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for status, response in op["responses"].items():
                links = _session_links(doc, status, response) | _object_links(doc, status, response)
                if "{conversation_id}" in path:
                    links |= _item_links(doc, status, response)
                if links:
                    response["links"] = links


def _targets(doc: dict, parameter: str) -> list[tuple[str, dict]]:
    """The operations whose path has `{parameter}`."""
    return [
        (op["operationId"], op)
        for path, ops in doc["paths"].items()
        if "{" + parameter + "}" in path
        for op in ops.values()
    ]


def _session_links(doc: dict, status: str, response: dict) -> dict:
    where = _session_field(doc, status, response)
    if where is None:
        return {}
    targets = _targets(doc, "session_id")
    return {target_id: _link(doc, target_id, target, where) for target_id, target in targets}


# a success body's `object` -> the path parameter its `id` fills
_OBJECT_IDS = {"response": "response_id", "conversation": "conversation_id"}


def _object_links(doc: dict, status: str, response: dict) -> dict:
    """A response's or a conversation's operations, with the id the body names; from a
    response also a response that continues it (`previous_response_id`)."""
    kind = _body_schema(doc, response).get("properties", {}).get("object", {}).get("const")
    if not status.startswith("2") or kind not in _OBJECT_IDS:
        return {}
    parameter = _OBJECT_IDS[kind]
    links: dict[str, Any] = {
        target_id: {"operationId": target_id, "parameters": {f"path.{parameter}": "$response.body#/id"}}
        for target_id, target in _targets(doc, parameter)
        if "{item_id}" not in _path_of(doc, target)
    }
    if kind == "response":
        for path, ops in doc["paths"].items():
            if path == "/v1/responses" and "post" in ops:
                target_id = ops["post"]["operationId"]
                links[target_id] = {
                    "operationId": target_id,
                    "requestBody": {"input": "and then?", "previous_response_id": "$response.body#/id"},
                }
    return links


def _item_links(doc: dict, status: str, response: dict) -> dict:
    """From a conversation's list of items (its listing, or the items just added) to the
    operations on its first item."""
    kind = _body_schema(doc, response).get("properties", {}).get("object", {}).get("const")
    if not status.startswith("2") or kind != "list":
        return {}
    parameters = {
        "path.conversation_id": "$request.path.conversation_id",
        "path.item_id": "$response.body#/first_id",
    }
    return {
        target_id: {"operationId": target_id, "parameters": parameters}
        for target_id, _ in _targets(doc, "item_id")
    }


def _path_of(doc: dict, target: dict) -> str:
    return next(path for path, ops in doc["paths"].items() if target in ops.values())


def _body_schema(doc: dict, op: dict) -> dict:
    """The JSON schema of an operation's (or a response's) JSON body, its `$ref` resolved."""
    ref = op.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return doc["components"]["schemas"].get(ref.removeprefix(_COMPONENT), {}) if ref else {}


def _session_field(doc: dict, status: str, response: dict) -> str | None:
    """The JSON pointer of the session id a success response names, if it names one."""
    if not status.startswith("2"):
        return None
    props = _body_schema(doc, response).get("properties", {})
    if {"id", "version"} <= set(props):  # SessionInfo: its route sends the version as ETag
        return "/id"
    if "session_id" in props and "choices" in props:  # an OpenAI completion
        return "/session_id"
    return None


def _link(doc: dict, target_id: str, target: dict, where: str) -> dict:
    """A link to `target` with the session the response names; from a SessionInfo also its
    version, as If-Match (its ETag), as `?version=`, and as a body's required `version`
    (a rollback to it), so that a stateful client reaches those routes' success too."""
    link: dict[str, Any] = {"operationId": target_id}
    parameters = link["parameters"] = {"path.session_id": f"$response.body#{where}"}
    if where != "/id":
        return link
    names = {p["name"] for p in target.get("parameters", [])}
    if "If-Match" in names:
        parameters["header.If-Match"] = "$response.header.ETag"
    if "version" in names:
        parameters["query.version"] = "$response.body#/version"
    if "version" in _body_schema(doc, target.get("requestBody", {})).get("required", []):
        link["requestBody"] = {"version": "$response.body#/version"}
    return link
