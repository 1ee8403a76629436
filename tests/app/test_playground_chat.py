"""The playground's chat view in a real headless Chromium against a real server serving a
tiny GGUF LLM (ChatML template in its metadata): message bubbles stream from
/v1/chat/completions, each turn sends only its new message with the session's id, and the
session holds the conversation as the server's template rendered it. A model without a
template gets a note and no Send."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import model
from tests.app.test_playground import KEY, OTHER, _attr, _open, _set, _shown, _wait
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


def test_a_model_without_a_chat_template_gets_a_note(browser, tiny_model_dir, redis_url, tmp_path_factory):
    settings = {"api_keys": KEY, "cpu_threads": 1}
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("no-chat"), redis_url, **settings) as srv:
        d = browser
        _open(d, srv)
        d.find_element("id", "view-chat").click()
        _wait(d, lambda _: "no chat template" in d.find_element("id", "chat-note").text)
        assert d.find_element("id", "send").get_attribute("disabled")
