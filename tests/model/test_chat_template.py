"""Chat templates: the play-script template's layout and role mapping, HF's files in a
checkpoint, the sandbox, and the text-level half of the prefix property (the token-level
half, through the server's defaults, is tests/app/test_chat_completions.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import model
from model import checkpoint
from model.chat_template import PLAY_SCRIPT, TURN_END, ChatTemplate, ChatTemplateError, play_script
from model.tokenizer import ByteTokenizer
from tests.conftest import TINY

SCENE = [
    {"role": "system", "content": "Enter Romeo and Juliet."},
    {"role": "user", "content": "Good morrow, fair saint."},
    {"role": "assistant", "content": "Good morrow, pilgrim."},
    {"role": "user", "name": "Mercutio", "content": "A plague o' both your houses!"},
]


def test_play_script_renders_the_plays_layout_with_its_role_mapping():
    t = play_script()
    assert t.stop == (TURN_END,) == ("\n\n",)
    assert t.render(SCENE) == (
        "[Enter Romeo and Juliet.]\n\n"  # system (and developer): a stage direction
        "Romeo.\nGood morrow, fair saint.\n\n"  # user: user_name, default Romeo
        "Juliet.\nGood morrow, pilgrim.\n\n"  # assistant: assistant_name, default Juliet
        "Mercutio.\nA plague o' both your houses!\n\n"  # a message's own name speaks it
        "Juliet.\n"  # the generation prompt: the assistant's turn opens
    )
    names = {"user_name": "Nurse", "assistant_name": "Friar", "messages": [], "add_generation_prompt": True}
    renamed = t.render(SCENE[1:3], names, add_generation_prompt=False)  # the last two are not its to change
    assert renamed == "Nurse.\nGood morrow, fair saint.\n\nFriar.\nGood morrow, pilgrim.\n\n"
    assert t.render([{"role": "developer", "content": "Exit."}]) == "[Exit.]\n\nJuliet.\n"


def test_a_role_the_template_has_no_part_for_is_refused():
    with pytest.raises(ChatTemplateError, match="no part for role tool"):
        play_script().render([{"role": "tool", "content": "42"}])


def test_a_template_runs_in_the_sandbox_never_as_python():
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(ChatTemplateError, match="unsafe"):  # immutable: it cannot change the messages
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ cycler.__init__.__globals__ }}").render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_hf_style_templates_render_as_hf_renders_them():
    """HF's variables (bos_token, eos_token, raise_exception) and its block trimming: a
    ChatML-like template as checkpoints on the Hub write it."""
    chatml = (
        "{{ bos_token }}{% for message in messages %}\n"
        "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    t = ChatTemplate(chatml)
    # BOS is a token the session consumes when it is made, never text: bos_token is ""
    assert (
        t.render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ChatTemplateError, match="bad role"):
        t.render([{"role": "system", "content": "x"}])


_text = st.text(st.characters(codec="utf-8"), max_size=40)
_turns = st.lists(st.tuples(_text, _text), min_size=1, max_size=5)


@given(turns=_turns, system=st.none() | _text)
def test_each_turn_renders_what_the_last_one_consumed_then_the_new_turn(turns, system):
    """A client that sends the whole conversation back renders, as bytes (the shipped
    models' tokens), exactly what the previous turn's state consumed: the previous prompt,
    the assistant's message and the turn stop that ended it, then the new messages."""
    t, tok = play_script(), ByteTokenizer()
    messages = [] if system is None else [{"role": "system", "content": system}]
    for user, reply in turns:
        messages.append({"role": "user", "content": user})
        prompt = tok.encode(t.render(messages))
        consumed = prompt + tok.encode(reply + t.stop[0])  # the generation ended by the turn stop
        messages.append({"role": "assistant", "content": reply})  # as the client keeps it: no stop
        after = tok.encode(t.render([*messages, {"role": "user", "content": "next"}]))
        assert after[: len(consumed)] == consumed and len(after) > len(consumed)


def test_shipped_checkpoints_carry_the_play_script_template():
    for name in ("shakespeare", "shakespeare-rlt"):
        t = checkpoint.chat_template(name)
        assert t is not None and t.source == PLAY_SCRIPT and t.stop == (TURN_END,)


def test_recur_init_writes_no_template_unless_given_one(tmp_path):
    model.init(tmp_path / "plain", seed=0, **TINY)
    assert checkpoint.chat_template(tmp_path / "plain") is None
    model.init(tmp_path / "chat", seed=0, chat_template=play_script(), **TINY)
    assert checkpoint.chat_template(tmp_path / "chat") == play_script()
    # the template is no part of the model: the same weights, the same fingerprint
    plain = model.load(tmp_path / "plain", device="cpu")
    assert plain.fingerprint == model.load(tmp_path / "chat", device="cpu").fingerprint


def test_hf_tokenizer_config_forms_are_read(tmp_path):
    model.init(tmp_path, seed=0, **TINY)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    t = checkpoint.chat_template(tmp_path)
    assert t is not None and t.stop == () and t.render([{"role": "user", "content": "x"}]) == "x"
    # several named templates: the default one; stop_strings may be one string
    config.write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"stop_strings": "\n"}))
    t = checkpoint.chat_template(tmp_path)
    assert t is not None and t.source == "D" and t.stop == ("\n",)
    # chat_template.jinja, HF's own file now, comes first
    (tmp_path / "chat_template.jinja").write_text("J")
    assert checkpoint.chat_template(tmp_path).source == "J"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "file, text, match",
    [
        ("chat_template.jinja", "{% if %}", "does not compile"),
        ("tokenizer_config.json", "{not json", "not JSON"),
        ("tokenizer_config.json", '{"chat_template": [{"name": "other", "template": "x"}]}', "default"),
        ("generation_config.json", '{"stop_strings": [""]}', "stop_strings"),
    ],
)
def test_a_broken_template_is_an_error_that_says_which_file(tmp_path, file, text, match):
    model.init(tmp_path, seed=0, chat_template=play_script(), **TINY)
    (tmp_path / file).write_text(text)
    if file == "tokenizer_config.json":
        (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match=match):
        checkpoint.chat_template(tmp_path)


# SmolLM2's template (its tokenizer_config.json): a default system block when the first
# message is no system one
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEMPLATES = [play_script(), ChatTemplate(SMOLLM2, ("<|im_end|>",))]
# contents without the templates' own markup (brackets, ChatML's bars), blank lines included
_content = st.text(st.sampled_from("abc XYZ.,?!'\n\u00e9\u4e2d"), max_size=30)


@given(template=st.sampled_from(_TEMPLATES), user=_content, system=st.none() | _content)
def test_a_rendered_turn_reads_back_as_its_messages(template, user, system):
    """A turn's text, as the first turn or a later one renders it, reads back as its messages
    (the playground's reopened chat, GET .../messages); a conversation's opening, whole, with
    more after it, or cut short in what follows the user's message, gives its first user
    message (the session list's preview): never the default system block."""
    turn = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": user}
    ]
    for text in (template.render(turn), template.render_continuation(turn)):
        assert template.read_turn(text) == turn
    opening = template.render(turn)
    assert template.first_user(opening) == user
    assert template.first_user(opening + "a reply<|im_end|>\n") == user
    after = opening[opening.rindex(user) + len(user) :] if user else ""
    for cut in range(1, len(after)):
        got = template.first_user(opening[: len(opening) - cut])
        # (a message that ends in blank space, cut short there, may lose that space)
        assert got is not None and user.startswith(got) and not user[len(got) :].strip()


def test_text_that_is_no_turn_reads_as_none():
    for template in _TEMPLATES:
        assert template.read_turn("ROMEO: a plain continuation") is None
        assert template.first_user("ROMEO: a plain continuation") is None


# Qwen3's way with reasoning (simplified): an assistant's <think> block is written only in
# the last reply, so an earlier reply's text depends on what comes after it
_REASONING = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and loop.last %}<think>\n</think>\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that counts the messages before each
_COUNTING = (
    "{% for message in messages %}[{{ messages|length }}] {{ message['role'] }}: {{ message['content'] }}"
    "\n\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": _content}
)


@given(template=st.sampled_from(_TEMPLATES), before=st.lists(_message, max_size=4), user=_content,
       reply=_content, later=st.lists(_message, min_size=1, max_size=3))  # fmt: skip
def test_a_template_that_composes_renders_the_whole_as_its_turns(template, before, user, reply, later):
    """Where a template composes (both shipped ones do), a conversation rendered whole is its
    earlier turns, then a reply as `reply` writes it after the generation prompt (through
    its turn stop), then the later messages as `render_continuation` writes them: what a
    server renders for a later turn alone equals the whole, which is rendered here
    independently."""
    assert template.composes()
    earlier = [*before, {"role": "user", "content": user}]  # (a reply answers someone)
    head = template.render(earlier)
    opening, text = template.reply({"role": "assistant", "content": reply})
    assert head.endswith(opening)
    whole = template.render([*earlier, {"role": "assistant", "content": reply}, *later])
    assert whole == head + text + template.render_continuation(later)


def test_a_template_that_writes_a_message_by_what_follows_does_not_compose():
    """A template that writes an earlier reply by what comes after it (a reasoning block only
    in the last reply), or counts the messages, does not compose: its turns render whole."""
    for source in (_REASONING, _COUNTING):
        template = ChatTemplate(source, ("<|im_end|>",) if "im_end" in source else ("\n\n",))
        assert not template.composes()
    assert ChatTemplate(SMOLLM2, ("<|im_end|>",)).composes()
    assert play_script().composes()
