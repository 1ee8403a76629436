"""`recur chat [SESSION] [--url URL]`: a terminal client for a running recur server.

It creates a session (or continues SESSION), then reads a prompt per line, and streams
the answer token by token as it arrives (Server-Sent Events over httpx). After each
turn it shows the session's id, version and token count. Ctrl-C during a generation
closes the stream: the server sees the disconnect, commits nothing, and the session stays
at its last version; the client returns to the prompt. Ctrl-C or Ctrl-D at the prompt,
or `/quit`, exits.

Two modes (`--mode`, default auto: chat where the served model has a chat template, as
GET /v1/models says). Chat: each line is a user message, sent alone to
/v1/chat/completions with the session's id, so the server applies the model's template
to it and continues the session (the assistant's turn ends at the template's stop).
Raw: each line is text the session continues (/v1/sessions/{id}/generate).

A client only: it never imports torch or the server, and speaks plain HTTP.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx

# how long the client reuses an idle connection: below the server's keep-alive timeout (5 s by
# default), where httpx's own default is 5 s too, so that a request never leaves on a
# connection the server is closing at that moment (a reset, docs/DEPLOY.md)
KEEPALIVE_EXPIRY = 2.0
HELP = "type a prompt and Enter to continue the session; /info shows it; /quit, Ctrl-D or Ctrl-C at the prompt exits"


class ChatError(Exception):
    """An error answer from the server, or no server at all."""


def _error(r: httpx.Response) -> ChatError:
    try:
        err = r.json()["error"]
        return ChatError(f"{r.status_code} {err['type']}: {err['message']}")
    except (ValueError, KeyError, TypeError):
        return ChatError(f"HTTP {r.status_code}: {r.text[:200]}")


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """(event name, JSON data) of each Server-Sent Event in `lines`, e.g. an httpx
    response's `iter_lines()`. Comments (`: ping`), unknown fields and OpenAI's closing
    `data: [DONE]` are skipped; an event left unfinished by the end of the stream is
    dropped, as the SSE spec says."""
    name = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data and data != ["[DONE]"]:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


class Chat:
    def __init__(self, client: httpx.Client, args: argparse.Namespace, out=sys.stdout):
        self.client = client
        self.args = args
        self.out = out
        self.session: dict = {}
        self.chat = False  # chat mode: lines are user messages (see the module docstring)

    def say(self, text: str, end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def status(self) -> str:
        s = self.session
        return f"[session {s['id']} · version {s['version']} · {s['n_tokens']} tokens]"

    def open(self, session_id: str | None) -> None:
        if session_id:
            r = self.client.get(f"/v1/sessions/{session_id}")
        else:
            r = self.client.post("/v1/sessions")
        if r.status_code not in (200, 201):
            raise _error(r)
        self.session = r.json()
        self.chat = self.args.mode == "chat" or (self.args.mode == "auto" and self._has_template())

    def _has_template(self) -> bool:
        r = self.client.get("/v1/models")
        if r.status_code != 200:
            raise _error(r)
        return any(card.get("chat_template") for card in r.json().get("data", []))

    def refresh(self) -> None:
        r = self.client.get(f"/v1/sessions/{self.session['id']}")
        if r.status_code != 200:
            raise _error(r)
        self.session = r.json()

    def generate(self, line: str) -> None:
        """One turn, streamed; Ctrl-C abandons it (nothing is committed)."""
        body: dict = {"max_tokens": self.args.max_tokens, "stream": True}
        if self.args.temperature is not None:  # (else the model's recommendation: GET /v1/models)
            body["temperature"] = self.args.temperature
        if self.args.seed is not None:
            body["seed"] = self.args.seed
        if self.chat:
            messages = [{"role": "user", "content": line}]
            if self.args.system and self.session["n_tokens"] == 0:
                messages.insert(0, {"role": "system", "content": self.args.system})
            url, body = (
                "/v1/chat/completions",
                {**body, "messages": messages, "session_id": self.session["id"]},
            )
        else:
            url = f"/v1/sessions/{self.session['id']}/generate"
            body["prompt"] = line + "\n" if self.args.newline else line
        try:
            self._stream(url, body)
        except KeyboardInterrupt:
            # leaving the `with` closed the connection: the server drops the generation
            self.say("")
            self.say(f"[cancelled; nothing committed, session stays at version {self.session['version']}]")

    def _stream(self, url: str, body: dict) -> None:
        for attempt in range(20):
            with self.client.stream("POST", url, json=body) as r:
                if r.status_code == 409 and attempt < 19:
                    # a just-cancelled turn may still hold the lock for a moment
                    r.read()
                    if r.json()["error"]["type"] == "session_busy":
                        time.sleep(0.1)
                        continue
                if r.status_code != 200:
                    r.read()
                    raise _error(r)
                for name, data in sse_events(r.iter_lines()):
                    if self._event(name, data):
                        return
                raise ChatError("the stream ended before the generation was done")

    def _event(self, name: str, data: dict) -> bool:
        """Show one event of either route's stream; True once the turn is done."""
        if name == "error" or "error" in data:
            self.say("")
            raise ChatError(f"{data['error']['type']}: {data['error']['message']}")
        choices = data.get("choices") or [{}]
        text = data.get("text", "") if name == "token" else choices[0].get("delta", {}).get("content") or ""
        self.out.write(text)
        self.out.flush()
        session = data.get("session") if name in ("done", "message") else None
        if session is not None and (name == "done" or choices[0].get("finish_reason")):
            self.session.update(session)
            self.say("")
            self.say(self.status())
            return True
        return False

    def loop(self, read=input) -> int:
        self.say(self.status())
        self.say(HELP)
        while True:
            try:
                line = read("> ")
            except (EOFError, KeyboardInterrupt):
                self.say("")
                return 0
            if line.strip() == "/quit":
                return 0
            try:
                if line.strip() == "/info":
                    self.refresh()
                    self.say(self.status())
                    continue
                self.generate(line)
            except ChatError as exc:
                self.say(f"error: {exc}")
            except httpx.HTTPError as exc:
                self.say(f"error: {exc.__class__.__name__}: {exc}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="talk to a running recur server in the terminal, streaming")
    p.add_argument("session", nargs="?", help="session id to continue (default: create a new session)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument(
        "--api-key-file", type=Path, help="file whose first line is the API key, if the server needs one"
    )
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per turn (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, help="0 = greedy (default: the model's recommendation, else 1)"
    )
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument(
        "--no-newline",
        dest="newline",
        action="store_false",
        help="raw mode: send each prompt line as typed (default: with its newline)",
    )
    p.add_argument(
        "--mode",
        choices=("auto", "chat", "raw"),
        default="auto",
        help="chat: each line is a user message, the server applies the model's chat template; raw: each line "
        "is text the session continues; auto (default): chat where the model has a chat template",
    )
    p.add_argument("--system", help="chat mode: a system message to open a new session's conversation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    headers = {}
    if args.api_key_file is not None:
        headers["Authorization"] = "Bearer " + args.api_key_file.read_text().splitlines()[0].strip()
    timeout = httpx.Timeout(10.0, read=None)  # a stream may pause for as long as the model needs
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY)
    with httpx.Client(base_url=args.url, headers=headers, timeout=timeout, limits=limits) as client:
        chat = Chat(client, args)
        try:
            chat.open(args.session)
        except (ChatError, httpx.HTTPError) as exc:
            print(f"recur chat: {exc}", file=sys.stderr)
            return 1
        return chat.loop()


def main(argv: list[str] | None = None, prog: str = "python -m app.chat") -> int:
    """`recur chat [SESSION] [--url URL]` (and `python -m app.chat`): the chat parser alone,
    without the model packages (`recur` loads torch for its other subcommands), so it starts
    at once and an error ends it at once."""
    parser = argparse.ArgumentParser(prog=prog)
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["chat", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
