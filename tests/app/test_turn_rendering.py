"""A later turn rendered alone, at the level of token ids, with the shipped assistant's own
template and tokenizer (SmolLM2's byte-level BPE, whose turn stop `<|im_end|>` is a special
token) and the shipped byte-level models' play script: the state's tokens, then the ids that
close its reply (`Renderer.closing`), then the turn's own (`Renderer.continuation`), are the
tokens of the whole conversation rendered and tokenized at once, the reference here. A
state that consumed other tokens than the template writes cannot be continued alone."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.openai.responses import Renderer
from model.chat_template import ChatTemplate, play_script
from model.checkpoint import chat_template, resolve
from model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.smollm2


@functools.cache
def renderers() -> dict[str, Renderer]:
    from model.llama_gguf import GGUF, tokenizer

    bpe = tokenizer(GGUF(resolve("smollm2")))
    smollm2 = chat_template("smollm2")
    assert isinstance(smollm2, ChatTemplate)
    limits = SimpleNamespace(max_prompt_tokens=1 << 20)
    out = {}
    for name, template, tok, size in (
        ("smollm2", smollm2, bpe, 49152),
        ("play", play_script(), ByteTokenizer(), 258),
    ):
        engine = SimpleNamespace(tokenize=tok.encode, vocab_size=size)  # (the real tokenizer, no model)
        out[name] = Renderer(template, limits, engine, instructions="Be brief.")
    return out


_text = st.text(st.sampled_from("ab XY.,?!'\n\t é中0123456789"), max_size=24)
_turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": _text})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["smollm2", "play"]), before=st.lists(_turn, max_size=3), user=_text,
       reply=_text, cut=st.integers(0, 6), later=st.lists(_turn, min_size=1, max_size=3))  # fmt: skip
def test_state_then_closing_then_the_turn_alone_is_the_whole(name, before, user, reply, cut, later):
    render = renderers()[name]
    if name == "play":  # (the play script has no part for a tool)
        before, later = (
            [{**m, "role": "user"} if m["role"] == "tool" else m for m in ms] for ms in (before, later)
        )
    earlier = [*before, {"role": "user", "content": user}]
    answer = {"role": "assistant", "content": reply}
    prompt = render(earlier, True)
    # the reply's tokens as the model wrote them through its turn stop, or cut short `cut` tokens
    # before its end (max_output_tokens): what the state consumed after the prompt
    written = render([*earlier, answer], False)[len(prompt) :]
    stop = render.template.stop[0]
    through = render._ids(render.template.reply(answer)[1])  # (its text through the stop, alone)
    consumed = through[: max(0, len(through) - cut)]
    if written[: len(through)] != through:  # (the prompt's last token and the reply's first merge
        # in the whole: a state that consumed them apart cannot continue alone)
        assert render.closing(answer, consumed) is None
        return
    closing = render.closing(answer, consumed)
    assert closing is not None, (reply, stop)
    alone = render.continuation(later)
    assert alone is not None
    whole = render([*earlier, answer, *later], True)
    assert [*prompt, *consumed, *closing, *alone] == whole


def test_a_state_that_consumed_other_tokens_cannot_continue_alone():
    render = renderers()["smollm2"]
    answer = {"role": "assistant", "content": "Paris is the capital."}
    through = render._ids(render.template.reply(answer)[1])
    assert render.closing(answer, through) == []  # (the state consumed the turn stop: nothing closes)
    bytewise = render.engine.tokenize("P") + render.engine.tokenize("aris") + through[1:]
    assert bytewise != through and render.closing(answer, bytewise) is None


def test_a_template_that_does_not_compose_never_renders_alone():
    reasoning = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
        "<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        ("<|im_end|>",),
    )
    base = renderers()["smollm2"]
    render = Renderer(reasoning, base.settings, base.engine)
    assert render.frame == "" and render.continuation([{"role": "user", "content": "x"}]) is None
    assert render.closing({"role": "assistant", "content": "y"}, []) is None
