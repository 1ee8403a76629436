"""`recur`: the one command-line entry point.

Model subcommands (init, train, eval, ...) are registered by `model.cli`; the service
subcommands (serve, chat, replay: replay reads a server's transcripts) by `app`. This
module only assembles the parser.

`recur chat` is a client of a running server and never imports torch: `main` hands it to
`app.chat` before anything imports `model` (torch takes seconds to import, a minute on a
loaded machine, and an error such as an unknown session would wait for it).
"""

from __future__ import annotations

import argparse
import sys

from app import chat, replay_client, serve


def build_parser() -> argparse.ArgumentParser:
    import model.cli  # imports torch: only for the subcommands that are more than a client

    parser = argparse.ArgumentParser(prog="recur", description="Streaming inference for recurrent-memory LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    model.cli.register(sub)
    serve.register(sub)
    chat.register(sub)
    replay_client.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chat"]:
        return chat.main(argv[1:], prog="recur")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
