"""`recur serve` (and `python -m app`): load the model, start Redis if needed, run uvicorn.

The command's flags are generated from `Settings`, so every setting has exactly one
definition: `--max-tokens 256` and `RECUR_MAX_TOKENS=256` are the same thing (a flag wins).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import typing
from pathlib import Path

from pydantic import SecretStr

from app.config import Settings

if typing.TYPE_CHECKING:
    import model

log = logging.getLogger("recur.serve")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        kwargs: dict[str, typing.Any] = {"dest": name, "default": argparse.SUPPRESS}
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        elif ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif ann in (int, float):
            kwargs["type"] = ann
        elif ann is Path or ann is str or args in ([str], [Path], [SecretStr]):
            kwargs["type"] = str
        else:  # a new settings type must say how it is parsed
            raise TypeError(f"no command-line parser for setting {name}: {ann}")
        env = f"RECUR_{name.upper()}"
        default = str(field.default) if isinstance(field.default, Path) else repr(field.default)
        kwargs["help"] = f"{field.description} (env {env}; default {default})"
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP, with sessions in Redis")
    add_settings_flags(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return run(Settings(**given))


class SetupError(Exception):
    """A setup mistake, said in one line (with what to do): the command exits with 2."""


def run(settings: Settings) -> int:
    import uvicorn

    from app import connections, logs
    from app.api import create_app
    from app.api.http.sse import SHUTDOWN_GRACE
    from app.embedded_redis import EmbeddedRedis, EmbeddedRedisError

    logs.configure(settings.log_level, settings.log_format)
    embedded = None
    try:
        _check_keys(settings)
        _find_model(settings)  # (before the embedded Redis makes its data directory)
        # Redis next, before the model's seconds of loading: a mistake there shows at once
        if settings.redis_url:
            _check_redis(settings)
        else:
            embedded = EmbeddedRedis(settings.data_dir, settings.data_max_mb)
            url = embedded.start()
            log.info("embedded redis-server at %s, data in %s", url, embedded.data_dir)
            settings = settings.model_copy(update={"redis_url": url})
        lm = _load_model(settings)
        # on Ctrl-C or SIGTERM, uvicorn stops taking requests, live streams end with their
        # final event (app.api.http.sse), the app shuts down, and only then is Redis stopped;
        # a connection or task still open twice the streams' grace later is cancelled: a stop
        # is bounded, whatever a client or a handler does
        uvicorn.run(
            create_app(settings, lm),
            host=settings.host,
            port=settings.port,
            http=connections.protocol(settings),
            timeout_keep_alive=settings.keep_alive_timeout,
            timeout_graceful_shutdown=int(2 * SHUTDOWN_GRACE),
            log_level=settings.log_level,
            log_config=None,  # keep the handlers of app.logs
            access_log=False,  # app.api.http.middleware logs each request, with its ids
        )
    except (SetupError, EmbeddedRedisError) as exc:
        print(f"recur serve: {exc}", file=sys.stderr)
        return 2
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def _check_keys(settings: Settings) -> None:
    try:
        keys = settings.load_api_keys()
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    if not keys:
        log.warning(
            "no API keys are set (RECUR_API_KEYS, RECUR_API_KEYS_FILE): every /v1 route is open to "
            "anyone who can reach %s:%d, and all clients share one quota",
            settings.host,
            settings.port,
        )


def _find_model(settings: Settings) -> None:
    import model

    try:
        model.checkpoint.resolve(settings.model)
    except FileNotFoundError as exc:
        raise SetupError(_no_model(exc)) from None


def _no_model(exc: FileNotFoundError) -> str:
    return (
        f"{exc}.\n  Pass --model DIR (a checkpoint directory, e.g. one written by "
        "`recur init DIR`) or set RECUR_MODEL."
    )


def _load_model(settings: Settings) -> model.LanguageModel:
    import model

    try:
        lm = model.load(
            settings.model,
            device=settings.device,
            precision=settings.precision,
            options=settings.model_options,
        )
        lm.set_state_dtype(settings.state_dtype)
        return lm
    except FileNotFoundError as exc:
        raise SetupError(_no_model(exc)) from None
    except ValueError as exc:  # a model option, precision or state dtype the checkpoint cannot take
        raise SetupError(str(exc)) from None


def _check_redis(settings: Settings) -> None:
    """A malformed URL or a Redis that does not answer fails the start (SetupError, one
    line), not every request after it."""
    from app.store import Store

    async def ping() -> None:
        store = Store.from_settings(settings)
        try:
            await store.ping()
        finally:
            await store.close()

    shown = redacted(settings.redis_url or "")
    try:
        asyncio.run(ping())
    except ValueError as exc:  # (redis-py and app.store.connection name the form expected)
        raise SetupError(f"--redis-url {shown} is malformed: {exc}") from None
    except Exception as exc:  # unreachable, refused, a wrong password, not a Redis
        raise SetupError(
            f"Redis at {shown} does not answer ({exc}); start it, or fix --redis-url (RECUR_REDIS_URL)"
        ) from None


def redacted(url: str) -> str:
    """`url` without its password, fit for a terminal or a log."""
    scheme, sep, rest = url.partition("://")
    creds, at, hosts = rest.partition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{hosts}"
