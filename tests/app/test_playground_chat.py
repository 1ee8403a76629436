"""The playground's chat view in a real headless Chromium against a real server serving a
tiny GGUF LLM (ChatML template in its metadata): message bubbles stream from
/v1/chat/completions, each turn sends only its new message with the session's id, and the
session holds the conversation as the server's template rendered it. A chat has its own
URL: opened by it, and reloaded, it shows the messages the server reads back
(GET .../messages). The session list shows each session's model, the served model's only
unless asked, and a chat's first user message as its preview. A model without a template
gets a note and no Send."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import model
from tests.app.test_playground import KEY, OTHER, _attr, _attrs, _click, _open, _set, _shown, _text, _wait
from tests.conftest import ServerProcess

SERVER_SETTINGS = {"max_tokens": 1000, "api_keys": f"{KEY}, {OTHER}", "cpu_threads": 1}


@pytest.fixture(scope="module")
def server(
    tiny_gguf: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with ServerProcess(
        tiny_gguf, tmp_path_factory.mktemp("chat-server"), redis_url, **SERVER_SETTINGS
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def other_server(
    server: ServerProcess, tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server of another model (a byte-level one, with no chat template) on the same Redis
    and keys, taking the same API key: its sessions are the same owner's, as two servers'
    on one ./data are."""
    settings = {"api_keys": KEY, "cpu_threads": 1, "key_prefix": server.settings["key_prefix"]}
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("no-chat"), redis_url, **settings) as srv:
        yield srv


def _bubbles(d) -> list[tuple[str, str, str]]:
    return [
        (b.get_attribute("data-role"), b.get_attribute("data-state"), b.get_attribute("textContent"))
        for b in d.find_elements("css selector", "#bubbles .bubble")
    ]


def _send(d, text: str, turns: int) -> None:
    _set(d, "message", text)
    d.find_element("id", "send").click()
    _wait(d, lambda _: sum(r == "assistant" and s == "done" for r, s, _ in _bubbles(d)) == turns)
    _shown(d, _attr(d, "info", "data-id"))


def test_chat_view_streams_bubbles_and_continues_one_session(browser, server, http, tiny_gguf):
    d = browser
    _open(d, server)
    d.find_element("id", "view-chat").click()
    _wait(d, lambda _: not d.find_element("id", "send").get_attribute("disabled"))
    _set(d, "max-tokens", "12")
    _set(d, "temperature", "0")
    _set(d, "system", "Be brief.")
    _send(d, "Good morrow.", 1)
    sid = _attr(d, "info", "data-id")
    _send(d, "And to you.", 2)
    assert _attr(d, "info", "data-id") == sid  # the same session, continued
    roles = [r for r, _, _ in _bubbles(d)]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    s = http.get(f"/v1/sessions/{sid}").json()
    assert s["version"] == 2
    # the session holds what the server's template rendered; the second turn sent only its
    # message, so its segment starts with that message's turn, not the whole conversation
    lm = model.load(tiny_gguf, device="cpu")
    segments = http.get(f"/v1/sessions/{sid}/transcript").json()["segments"]
    by_version = {v: [i for seg in segments if seg["version"] == v for i in seg["ids"]] for v in (0, 1, 2)}
    assert by_version[0] == []  # the chat's session was made empty (this model has no BOS)
    first, second = lm.tokenizer.decode(by_version[1]), lm.tokenizer.decode(by_version[2])
    assert first.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGood morrow.<|im_end|>\n"
    )
    # the second turn renders what follows the first's turn stop (c82773c): its separator first
    turn = "\n<|im_start|>user\nAnd to you.<|im_end|>\n<|im_start|>assistant\n"
    assert second.startswith(turn)
    answers = [t for r, _, t in _bubbles(d) if r == "assistant"]
    assert second.removeprefix(turn).startswith(answers[1])
    assert answers[0] and answers[0] in first


def _chat_shown(d, sid: str, messages: list[tuple[str, str]]) -> None:
    """Wait until the page shows the chat view of session `sid` with `messages` read back."""
    box = "#bubbles"
    _wait(
        d,
        lambda _: (
            _attr(d, "view-chat", "aria-pressed") == "true"
            and d.find_element("css selector", box).get_attribute("data-session") == sid
            and d.find_element("css selector", box).get_attribute("data-state") == "loaded"
        ),
    )
    assert [(r, t) for r, _, t in _bubbles(d)] == messages
    assert _attr(d, "info", "data-id") == sid


def test_a_chat_opens_by_its_url_and_survives_a_reload(browser, server, http):
    d = browser
    _open(d, server)
    d.find_element("id", "view-chat").click()
    _wait(d, lambda _: not d.find_element("id", "send").get_attribute("disabled"))
    assert d.current_url.endswith("#chat")  # a new chat
    _set(d, "max-tokens", "6")
    _set(d, "temperature", "0")
    _set(d, "system", "Be brief.")
    _send(d, "Good morrow.", 1)
    _send(d, "And to you.", 2)
    sid = _attr(d, "info", "data-id")
    assert d.current_url.endswith(f"#chat/{sid}")
    shown = [(r, t) for r, _, t in _bubbles(d)]
    assert [r for r, _ in shown] == ["system", "user", "assistant", "user", "assistant"]
    # the server reads the chat back from what the session consumed, turn by turn
    read = http.get(f"/v1/sessions/{sid}/messages").json()
    assert [(m["role"], m["content"]) for m in read["messages"]] == shown
    assert [m["version"] for m in read["messages"]] == [1, 1, 1, 2, 2] and read["complete"]
    # opened by its URL in a new page (the key kept by the tab), then reloaded: the same chat
    d.get("about:blank")
    d.get(f"{server.url}/#chat/{sid}")
    _chat_shown(d, sid, shown)
    d.refresh()
    _chat_shown(d, sid, shown)
    # the session view has its own URL too, and the chat view comes back from it
    d.find_element("id", "view-raw").click()
    assert d.current_url.endswith(f"#{sid}") and "#chat" not in d.current_url
    d.refresh()
    _shown(d, sid)
    assert _attr(d, "view-raw", "aria-pressed") == "true"
    d.find_element("id", "view-chat").click()
    _chat_shown(d, sid, shown)


def test_the_list_shows_each_sessions_model_and_a_chats_first_user_message(
    browser, server, http, other_server
):
    served = http.get("/v1/models").json()["data"][0]["id"]
    with other_server.client(headers={"Authorization": f"Bearer {KEY}"}) as theirs_http:
        other = theirs_http.get("/v1/models").json()["data"][0]["id"]
        theirs = theirs_http.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    assert served != other
    # a chat, as the page and `recur chat` make one: an empty session, then its first turn
    chat = http.post("/v1/sessions", json={}).json()["id"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    body = {"messages": messages, "session_id": chat, "max_tokens": 3, "temperature": 0}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    raw = http.post("/v1/sessions", json={"prompt": "plain words"}).json()["id"]
    listed = {s["id"]: s for s in http.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]}
    # a chat's preview is its first user message: no system block, no special tokens
    assert listed[chat]["preview"] == "What is the capital of France?"
    assert listed[raw]["preview"] == "plain words"
    # another model's session: listed with its model, and no preview this tokenizer would garble
    assert listed[theirs]["model"] == other and listed[theirs]["preview"] == ""
    only = http.get("/v1/sessions", params={"limit": 1000, "model": served}).json()["sessions"]
    assert {chat, raw} <= {s["id"] for s in only} and all(s["model"] == served for s in only)
    # a chat of another model is not read with this one's template and tokenizer
    r = http.get(f"/v1/sessions/{theirs}/messages")
    assert r.status_code == 409 and r.json()["error"]["type"] == "model_mismatch"

    d = browser
    _open(d, server)  # the served model's sessions only, by default

    def button(sid: str):
        return d.find_elements("css selector", f'#sessions button[data-id="{sid}"]')

    _wait(d, lambda _: button(chat))
    assert not button(theirs)
    mine, their = (f'#sessions button[data-id="{sid}"]' for sid in (chat, theirs))
    assert _attrs(d, mine, "data-model") == [served]
    assert _text(d, mine).startswith("What is the capital of France?") and f" · {served} · " in _text(d, mine)
    d.find_element("id", "all-models").click()
    _wait(d, lambda _: button(theirs))
    assert _attrs(d, their, "data-model") == [other] and f"(a {other} session)" in _text(d, their)
    assert button(chat) and button(raw)
    # opened, it says whose it is, and offers no Generate the server would refuse
    _click(d, their)
    _shown(d, theirs)
    assert "not the served model" in d.find_element("id", "info").text
    assert d.find_element("id", "generate").get_attribute("disabled")


def test_a_model_without_a_chat_template_gets_a_note(browser, other_server):
    d = browser
    _open(d, other_server)
    d.find_element("id", "view-chat").click()
    _wait(d, lambda _: "no chat template" in d.find_element("id", "chat-note").text)
    assert d.find_element("id", "send").get_attribute("disabled")
