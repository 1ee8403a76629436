"""`POST /v1/chat/completions` over real HTTP against the shipped byte-level models (both
families, with their play-script template), and tiny checkpoints with no template or a
template of their own.

The property a stateless client relies on is pinned here: a conversation sent back whole,
with the assistant's messages as the route returned them (no turn stop), renders token ids
that extend exactly what the previous turn's session state consumed (its transcript)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from model import checkpoint
from model.chat_template import ChatTemplate, play_script
from tests.conftest import TINY, ServerProcess
from tests.sensitive import write_sensitive

SCENE = [
    {"role": "system", "content": "Enter Romeo and Juliet."},
    {"role": "user", "content": "But soft! What light through yonder window breaks?"},
]
LINES = ["Speak again, bright angel!", "With love's light wings did I o'erperch these walls.", "Good night."]


@pytest.fixture(scope="module", params=["shakespeare", "shakespeare-rlt"])
def server(request, redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        request.param, tmp_path_factory.mktemp("server"), redis_url, cpu_threads=1, max_tokens=300
    ) as srv:
        yield srv


def _consumed(http: httpx.Client, sid: str) -> list[int]:
    """Every token id the session's state has consumed, in order (its transcript)."""
    r = http.get(f"/v1/sessions/{sid}/transcript")
    assert r.status_code == 200, r.text
    t = r.json()
    assert t["complete"]
    return [i for seg in t["segments"] for i in seg["ids"]]


def _tokenize(http: httpx.Client, text: str) -> list[int]:
    """The ids a new session consumes for `text` (BOS first)."""
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _reply(oa: openai.OpenAI, server: ServerProcess, messages: list, finish: str = "stop", **body: object):
    """A reply that ends as `finish` says, in valid UTF-8, from the first seed that gives
    one. (A byte-level model may sample bytes that are no UTF-8: the text returned holds
    U+FFFD for them, and a client sending it back sends other bytes; docs/OPENAI.md.)"""
    for seed in range(20):
        c = oa.chat.completions.create(model=server.model_dir, messages=messages, seed=seed, **body)  # type: ignore[call-overload]
        if c.choices[0].finish_reason == finish and "\ufffd" not in c.choices[0].message.content:
            return c, seed
    raise AssertionError(f"no seed of 20 gave a reply that ends with {finish}")


def test_a_chat_completion_in_a_new_session(oa, http, server):
    _, seed = _reply(oa, server, SCENE)
    raw = oa.chat.completions.with_raw_response.create(model=server.model_dir, messages=SCENE, seed=seed)
    c = raw.parse()
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-") and c.model == server.model_dir
    assert c.system_fingerprint == http.get("/readyz").json()["fingerprint"]
    (choice,) = c.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    # the model ended its turn: the turn stop, which the message leaves out
    assert choice.finish_reason == "stop" and choice.message.content and "\n\n" not in choice.message.content
    prompt = play_script().render(SCENE)
    assert c.usage.prompt_tokens == len(prompt.encode())
    sid = c.session_id  # type: ignore[attr-defined]
    assert raw.headers["x-session-id"] == sid == c.session["id"]  # type: ignore[attr-defined]
    consumed = _consumed(http, sid)  # BOS, the prompt, the message and the turn stop
    assert len(consumed) == c.session["n_tokens"] == 1 + c.usage.prompt_tokens + c.usage.completion_tokens  # type: ignore[attr-defined]
    assert bytes(consumed[1:]).decode() == prompt + choice.message.content + "\n\n"


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_resent_conversation_extends_what_the_last_turn_consumed(oa, http, server, finish):
    """The stateless client: each turn sends the whole conversation, holding the assistant's
    messages as returned (without the turn stop). With the route's defaults (the turn stop)
    or cut short by max_tokens, every turn's prompt starts with every token the previous
    turn's state consumed."""
    limit = {} if finish == "stop" else {"max_tokens": 7}
    messages = list(SCENE)
    for line in LINES:
        c, _ = _reply(oa, server, messages, finish, temperature=0.8, **limit)
        consumed = _consumed(http, c.session_id)  # type: ignore[attr-defined]
        messages += [
            {"role": "assistant", "content": c.choices[0].message.content},
            {"role": "user", "content": line},
        ]
        after = _tokenize(http, play_script().render(messages))
        assert after[: len(consumed)] == consumed and len(after) > len(consumed)


def test_a_continued_session_takes_only_the_new_messages(oa, http, server):
    """Continuing a session with the new messages makes the state a stateless client's
    resent conversation makes (after a turn the turn stop ended): the same tokens, so the
    same greedy reply."""
    first, _ = _reply(oa, server, SCENE)
    sid = first.session_id  # type: ignore[attr-defined]
    new = [{"role": "user", "content": LINES[0]}]
    second = oa.chat.completions.create(
        model=server.model_dir, messages=new, temperature=0, extra_body={"session_id": sid}
    )
    assert second.session_id == sid and second.session["version"] == 2  # type: ignore[attr-defined]
    assert second.usage.prompt_tokens == len(play_script().render(new).encode())
    whole = [*SCENE, {"role": "assistant", "content": first.choices[0].message.content}, *new]
    stateless = oa.chat.completions.create(model=server.model_dir, messages=whole, temperature=0)
    assert stateless.choices[0].message.content == second.choices[0].message.content
    assert _consumed(http, sid) == _consumed(http, stateless.session_id)  # type: ignore[attr-defined]


def test_streamed_chunks_role_content_finish_usage_done(oa, http, server):
    whole, seed = _reply(oa, server, SCENE)  # the turn stop ends it: the stream holds back its first "\n"
    body = {"model": server.model_dir, "messages": SCENE, "seed": seed}
    chunks = list(oa.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    first, *content, last, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None and c.choices[0].delta.role is None for c in content)
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    assert last.choices[0].finish_reason == "stop" and last.choices[0].delta.content is None
    assert last.session["n_tokens"] == whole.session["n_tokens"]  # type: ignore[attr-defined]
    assert usage.choices == [] and usage.usage == whole.usage
    # vLLM's include_stop_str_in_output keeps the turn stop, streamed or not
    kept = oa.chat.completions.create(**body, extra_body={"include_stop_str_in_output": True})  # type: ignore[call-overload]
    assert kept.choices[0].message.content == whole.choices[0].message.content + "\n\n"

    # on the wire: data-only events; the last delta is {}; then [DONE]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and len(r.headers["x-session-id"]) == 32
        data = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data:")]
    assert data[-1] == "[DONE]"
    chunks_json = [json.loads(d) for d in data[:-1]]
    assert chunks_json[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks_json[-1]["choices"][0]["delta"] == {} and chunks_json[-1]["usage"] is None


def test_logprobs_stop_strings_and_max_completion_tokens(oa, server):
    c = oa.chat.completions.create(
        model=server.model_dir, messages=SCENE, seed=2, logprobs=True, max_completion_tokens=40, max_tokens=1
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.content is not None
    # every token the state consumed, the turn stop's too
    assert len(lp.content) == c.usage.completion_tokens and all(t.logprob <= 0 for t in lp.content)
    text = "".join(t.token for t in lp.content)
    assert bytes(b for t in lp.content for b in (t.bytes or [])) == text.encode()
    if c.choices[0].finish_reason == "stop":
        assert text == c.choices[0].message.content + "\n\n"
    else:  # max_completion_tokens won over max_tokens
        assert c.usage.completion_tokens == 40 and text == c.choices[0].message.content
    # a body's stop strings end the turn too, and are left out like the turn stop
    s = oa.chat.completions.create(model=server.model_dir, messages=SCENE, seed=2, stop=["e"], logprobs=True)
    assert s.choices[0].finish_reason == "stop" and "e" not in s.choices[0].message.content
    assert "".join(t.token for t in s.choices[0].logprobs.content) == s.choices[0].message.content + "e"  # type: ignore[union-attr]


def test_bad_chat_requests_get_the_error_body(oa, http, server):
    with pytest.raises(openai.UnprocessableEntityError, match="n"):
        oa.chat.completions.create(model=server.model_dir, messages=SCENE, n=17)  # past 16 choices
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=SCENE)
    for bad in (
        {"messages": []},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": SCENE, "response_format": {"type": "json_schema"}},  # (no schema: tests/app/test_tools.py)
        {"messages": SCENE, "top_logprobs": 21, "logprobs": True},
    ):
        r = http.post("/v1/chat/completions", json=bad)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)


def test_text_parts_names_and_template_variables(oa, server):
    parts = [
        {
            "role": "user",
            "name": "Mercutio",
            "content": [{"type": "text", "text": "A plague"}, {"type": "text", "text": "o' both"}],
        }
    ]
    c = oa.chat.completions.create(
        model=server.model_dir,
        messages=parts,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"assistant_name": "Nurse"}},
    )
    # the prompt as the template renders it: the message's name, the parts joined, the variable
    assert c.usage.prompt_tokens == len("Mercutio.\nA plague\no' both\n\nNurse.\n")


# -- checkpoints without the shipped template ---------------------------------------------------
# ChatML with a default system block when the conversation opens without one, as SmolLM2's
DEFAULT_SYSTEM = ChatTemplate(
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ("<|im_end|>",),
)


def _tiny(directory: Path, template: ChatTemplate | None) -> Path:
    write_sensitive(directory, seed=0, chat_template=template, **TINY)
    return directory


@pytest.fixture(scope="module")
def custom(redis_url, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    strict = ChatTemplate(
        "{% if messages[-1].role != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}"
        "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        ("\n",),
    )
    servers = tuple(
        ServerProcess(
            _tiny(tmp_path_factory.mktemp(name) / "tiny", t), tmp_path_factory.mktemp(name), redis_url
        )
        for name, t in (("none", None), ("strict", strict), ("system", DEFAULT_SYSTEM))
    )
    for s in servers:
        s.start()
    yield servers  # type: ignore[misc]
    for s in servers:
        s.stop()


def test_a_checkpoint_without_a_template_cannot_chat_but_completes(custom):
    none, _, _ = custom
    with none.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": SCENE})
        assert r.status_code == 400 and r.json()["error"]["type"] == "no_chat_template"
        assert "chat template" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
    assert checkpoint.chat_template(none.model_dir) is None


def test_a_template_of_its_own_refuses_and_stops_its_way(custom):
    _, strict, _ = custom
    with strict.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "x"}]})
        assert r.status_code == 422 and "the last message must be the user's" in r.json()["error"]["message"]
        # its turn stop ("\n") is the route's default stop; the template's variables cannot replace the messages
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": "x"}}
        r = http.post("/v1/chat/completions", json={**body, "max_tokens": 200, "seed": 0})
        assert r.status_code == 200, r.text
        c = r.json()
        assert c["usage"]["prompt_tokens"] == len("user: hi\n")
        assert "\n" not in c["choices"][0]["message"]["content"]


def test_a_continued_chat_opens_with_the_default_system_block_once(custom):
    """Issue 44: a template that opens a conversation with a default system block rendered it
    again before every continued turn. A continuation now renders only what follows the
    state's last turn stop: the block appears once in the session's transcript."""
    _, _, system = custom
    oa = system.openai()
    block = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>"
    first = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hail."}], temperature=0, max_tokens=8,
        extra_body={"min_tokens": 8},
    )  # fmt: skip
    sid = first.session_id  # type: ignore[attr-defined]
    new = [{"role": "user", "content": "Again."}]
    second = oa.chat.completions.create(
        model="tiny", messages=new, temperature=0, max_tokens=8, extra_body={"session_id": sid}
    )
    with system.client() as http:
        text = "".join(seg["text"] for seg in http.get(f"/v1/sessions/{sid}/transcript").json()["segments"])
    assert text.count(block) == 1, text
    # the second turn's prompt is what follows the first reply's turn stop in the whole
    # conversation, as ChatML writes it
    assert second.usage.prompt_tokens == len("\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith(
        "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n" + second.choices[0].message.content
    )
