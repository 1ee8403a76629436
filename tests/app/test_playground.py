"""The playground page (`GET /`) in a real headless Chromium, driven with Selenium and the
system chromedriver, against a real server (with API keys: the page sends one) and Redis:
the session list, create/generate/fork/delete, the transcript's log-prob tints, fork here
and roll back to here on the version timeline, download and upload of the state, and Stop
keeping what was streamed. Each browser test checks the page's DOM against what the API
says; and the GET streaming route, which clients without fetch streaming use."""

from __future__ import annotations

import colorsys
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess

from .sse_client import events

KEY, OTHER = "key-playground-0123", "key-someone-else-4567"
# max_tokens so high that a generation is still running when Stop is clicked
SERVER_SETTINGS = {"max_tokens": 100_000, "api_keys": f"{KEY}, {OTHER}"}
TINT_FLOOR = -8.0  # the page's: log-probs at or below it get the reddest tint


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """The API as the page's key sees it (overrides conftest's keyless client)."""
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _wait(driver, predicate, timeout: float = 60):
    """Wait until `predicate` holds; an element the page re-rendered meanwhile (stale) is
    looked up again at the next poll."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver, timeout, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException]
    )
    return wait.until(lambda d: predicate(d))


def _click(driver, selector: str) -> None:
    """Click the element `selector` matches, looking it up again if the page re-rendered it
    between the lookup and the click (the session list is redrawn by each list load)."""

    def clicked(d) -> bool:
        d.find_element("css selector", selector).click()
        return True

    _wait(driver, clicked)


def _set(driver, element_id: str, value: str) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(value)


def _attr(driver, element_id: str, name: str) -> str | None:
    return driver.find_element("id", element_id).get_attribute(name)


def _attrs(driver, selector: str, name: str) -> list[str | None]:
    """Attribute `name` of every element `selector` matches, read in one script: the page
    may re-render a list between a lookup and a read of its elements (a stale element)."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))"
    return driver.execute_script(script, selector, name)


def _text(driver, selector: str) -> str:
    """The rendered text of the element `selector` matches, looked up and read in one script."""
    return driver.execute_script("return document.querySelector(arguments[0]).innerText", selector)


def _versions(driver, selector: str) -> list[int]:
    return [int(v or -1) for v in _attrs(driver, selector, "data-version")]


def _status(driver) -> str:
    return driver.find_element("id", "status").text


def _open(driver, server: ServerProcess, sid: str | None = None, key: str = KEY) -> None:
    """Load the page, enter the key (the list loads), and open session `sid` from the list."""
    from selenium.webdriver.common.keys import Keys

    driver.get(server.url + "/")
    # (the tab's sessionStorage may keep an earlier test's key: forgotten, with no change event)
    driver.execute_script("sessionStorage.clear(); document.getElementById('api-key').value = '';")
    driver.find_element("id", "api-key").send_keys(key, Keys.TAB)  # the change event
    _wait(driver, lambda d: _attr(d, "sessions", "data-state") == "loaded" and "error" not in _status(d))
    if sid is not None:
        _click(driver, f'#sessions button[data-id="{sid}"]')
        _shown(driver, sid)


def _shown(driver, sid: str) -> None:
    """Wait until the page shows session `sid`, with its transcript and versions read back."""

    def ready(d) -> bool:
        version = _attr(d, "info", "data-version")
        return (
            _attr(d, "info", "data-id") == sid
            and _attr(d, "transcript", "data-state") == "loaded"
            and _attr(d, "transcript", "data-session") == sid
            and _attr(d, "transcript", "data-version") == version
            and _attr(d, "versions", "data-state") == "loaded"
            and _attr(d, "versions", "data-version") == version
        )

    _wait(driver, ready)


def _new_session(http: httpx.Client, prompt: str = "ROMEO:") -> str:
    r = http.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _continue(http: httpx.Client, sid: str, prompt: str, **sampling: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": False, **sampling}
    r = http.post(f"/v1/sessions/{sid}/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(segments: list[dict]) -> list[int]:
    return [i for seg in segments for i in seg["ids"]]


def test_page_is_self_contained(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # nothing is fetched from anywhere else: no external URL, and a CSP that forbids it
    assert "http://" not in r.text and "https://" not in r.text and "//cdn" not in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    # the page needs no key (it asks for one), unlike the API
    assert httpx.get(str(http.base_url) + "/v1/sessions").status_code == 401


def test_docs_work_offline(browser, server, http):
    """/docs and /redoc load Swagger UI and ReDoc from this server (a package's files), never
    from a CDN: every asset the pages name is same-origin and loads, and Swagger UI renders
    the API in a browser that reaches nothing else."""
    for page in ("/docs", "/redoc"):
        r = httpx.get(server.url + page)  # no key: the docs are public, as /openapi.json is
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), page
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
        assets += re.findall(r"""(?:url|openapi_url|oauth2RedirectUrl)['"]?\s*:\s*['"]([^'"]+)['"]""", r.text)
        assert assets, page
        for url in assets:
            assert url.startswith("/") and not url.startswith("//"), (page, url)
            assert httpx.get(server.url + url).status_code == 200, (page, url)
        assert "cdn" not in r.text.lower() and "https://" not in r.text, page
    browser.get(server.url + "/docs")
    _wait(browser, lambda d: d.find_elements("css selector", ".swagger-ui .info .title"))
    assert "recur" in browser.find_element("css selector", ".swagger-ui .info .title").text
    assert browser.find_elements("css selector", ".swagger-ui .opblock")  # the routes are drawn


def test_get_generate_streams_like_post(http):
    a = _new_session(http, "Once")
    b = http.post(f"/v1/sessions/{a}/fork").json()["id"]
    params = {"prompt": " upon", "max_tokens": 6, "temperature": 0, "logprobs": "true"}
    with http.stream("GET", f"/v1/sessions/{a}/generate", params=params) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = list(events(r))
    body = {"prompt": " upon", "max_tokens": 6, "temperature": 0, "logprobs": True}
    with http.stream("POST", f"/v1/sessions/{b}/generate", json=body) as r:
        want = list(events(r))
    got_tokens = [e[1] for e in got if e[0] == "token"]
    want_tokens = [e[1] for e in want if e[0] == "token"]
    # the same tokens; log-probs to a tolerance: the fork's state comes from Redis, its
    # key/value caches rebuilt in one pass, which need not round like the original's
    assert [(t["index"], t["id"], t["text"]) for t in got_tokens] == [
        (t["index"], t["id"], t["text"]) for t in want_tokens
    ]
    assert [t["logprob"] for t in got_tokens] == pytest.approx([t["logprob"] for t in want_tokens], abs=1e-6)
    assert got[-1][0] == "done" and got[-1][1]["session"]["version"] == 1
    assert got[-1][1]["text"] == want[-1][1]["text"]
    bad = http.get(f"/v1/sessions/{a}/generate", params={"max_tokens": "many"})
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_request"


def test_session_list_shows_the_keys_sessions_and_opens_one(browser, server, http):
    mine = _new_session(http)
    _continue(http, mine, "\nJULIET:")
    with server.client(headers={"Authorization": f"Bearer {OTHER}"}) as other:
        theirs = other.post("/v1/sessions", json={"prompt": "x"}).json()["id"]
    d = browser
    _open(d, server)
    entry = f'#sessions button[data-id="{mine}"]'
    _wait(d, lambda _: d.find_elements("css selector", entry))
    listed = set(_attrs(d, "#sessions button", "data-id"))
    api = {s["id"] for s in http.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]}
    assert listed == api and theirs not in listed  # the key's sessions, and only those
    s = http.get(f"/v1/sessions/{mine}").json()
    assert f"v{s['version']} · {s['n_tokens']} tokens" in _text(d, entry)
    _click(d, entry)
    _shown(d, mine)
    assert _attr(d, "info", "data-version") == "1" and _attr(d, "info", "data-n-tokens") == str(s["n_tokens"])
    assert _attrs(d, entry, "aria-current") == ["true"]


def test_create_generate_fork_delete(browser, server, http):
    d = browser
    _open(d, server)
    _set(d, "new-prompt", "ROMEO:")
    d.find_element("id", "create").click()
    _wait(d, lambda _: _attr(d, "info", "data-id"))
    sid = _attr(d, "info", "data-id")
    assert sid is not None
    _shown(d, sid)
    assert _attr(d, "info", "data-version") == "0" and _attr(d, "info", "data-n-tokens") == "7"
    assert d.find_elements("css selector", f'#sessions button[data-id="{sid}"]')  # listed

    _set(d, "prompt", "\nJULIET:")
    _set(d, "max-tokens", "24")
    _set(d, "temperature", "0")
    d.find_element("id", "generate").click()
    _wait(d, lambda _: _attr(d, "output", "data-state") in ("done", "error"))
    assert _attr(d, "output", "data-state") == "done", _status(d)
    streamed = d.find_element("id", "output").get_attribute("textContent")
    _shown(d, sid)

    # the page shows what the server committed
    s = http.get(f"/v1/sessions/{sid}").json()
    assert s["version"] == 1 and s["n_tokens"] == 1 + 6 + 8 + 24
    assert _attr(d, "info", "data-version") == "1" and _attr(d, "info", "data-n-tokens") == str(s["n_tokens"])
    # and the streamed text is what the session generated: the same greedy turn on a twin
    twin = _new_session(http)
    assert streamed == _continue(http, twin, "\nJULIET:", max_tokens=24)["text"]
    assert len(streamed) > 0

    d.find_element("id", "fork").click()
    _wait(d, lambda _: _attr(d, "info", "data-id") not in (None, sid))
    fork = _attr(d, "info", "data-id")
    f = http.get(f"/v1/sessions/{fork}").json()
    assert f["n_tokens"] == s["n_tokens"] and f["version"] == 0

    d.find_element("id", "delete").click()
    _wait(d, lambda _: "deleted" in _status(d))
    assert http.get(f"/v1/sessions/{fork}").status_code == 404
    assert http.get(f"/v1/sessions/{sid}").status_code == 200
    ids = _attrs(d, "#sessions button", "data-id")
    assert sid in ids and fork not in ids


def _tint_rgb(logprob: float) -> tuple[int, int, int]:
    """The page's tint of a log-prob: hsl(hue, 75%, 80%), hue 120 (green) at 0 to 0 (red) at the floor."""
    hue = round(120 * (1 - min(1.0, max(0.0, logprob / TINT_FLOOR))))
    r, g, b = colorsys.hls_to_rgb(hue / 360, 0.8, 0.75)
    return round(r * 255), round(g * 255), round(b * 255)


def _rgb(css: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(, [\d.]+)?\)", css)
    assert m, css
    return int(m[1]), int(m[2]), int(m[3])


def test_transcript_tints_each_sampled_token_by_its_logprob(browser, server, http):
    sid = _new_session(http)
    _continue(http, sid, "\nJULIET:", max_tokens=12, temperature=1.0, seed=3)
    http.post(f"/v1/sessions/{sid}/score", json={"prompt": " Ay me", "commit": True}).raise_for_status()
    _continue(http, sid, "!", max_tokens=6, temperature=0.7, top_p=0.9, seed=4)
    t = http.get(f"/v1/sessions/{sid}/transcript").json()
    assert [seg["kind"] for seg in t["segments"]] == ["create", "generate", "score", "generate"]

    d = browser
    _open(d, server, sid)
    assert _attr(d, "transcript", "data-n-tokens") == str(t["n_tokens"])
    n_sampled = 0
    for seg in t["segments"]:
        shown = d.find_element("css selector", f'#transcript .seg[data-version="{seg["version"]}"]')
        assert shown.get_attribute("data-kind") == seg["kind"]
        toks = shown.find_elements("css selector", ".tok")
        # one span per token, in order, whose texts make up the segment's text
        assert [int(s.get_attribute("data-id")) for s in toks] == seg["ids"], (
            "no span per token: the page needs each id's own text, the segment's `texts` "
            f"(it has {sorted(seg)}), unless the text splits into code points one per id"
        )
        assert "".join(s.get_attribute("textContent") for s in toks) == seg["text"]
        for span, sampled, lp in zip(toks, seg["sampled"], seg["logprobs"], strict=True):
            title = span.get_attribute("title")
            if not sampled:  # a prompt token: untinted, no value
                assert not title and span.value_of_css_property("background-color") == "rgba(0, 0, 0, 0)"
                assert "sampled" not in span.get_attribute("class")
                continue
            n_sampled += 1
            m = re.search(r"log-prob (-?\d+\.\d+)", title)
            assert m, title
            assert float(m[1]) == pytest.approx(lp, abs=1e-4)
            got = _rgb(span.value_of_css_property("background-color"))
            assert all(abs(a - b) <= 1 for a, b in zip(got, _tint_rgb(lp), strict=True)), (got, lp)
    assert n_sampled == 12 + 6


def test_fork_here_copies_the_history_up_to_that_version(browser, server, http):
    sid = _new_session(http)
    _continue(http, sid, "\nJULIET:")
    _continue(http, sid, "\nROMEO:")
    parent = http.get(f"/v1/sessions/{sid}/transcript").json()
    kept = {v["version"]: v for v in http.get(f"/v1/sessions/{sid}/versions").json()["versions"]}
    assert set(kept) == {0, 1, 2}

    d = browser
    _open(d, server, sid)
    assert _versions(d, "#versions li") == [0, 1, 2]
    _click(d, '#versions li[data-version="1"] button.fork-here')
    _wait(d, lambda _: _attr(d, "info", "data-id") not in (None, sid))
    fork = _attr(d, "info", "data-id")
    assert fork is not None
    _shown(d, fork)

    t = http.get(f"/v1/sessions/{fork}/transcript").json()
    upto = [seg for seg in parent["segments"] if seg["version"] <= 1]
    assert _ids(t["segments"]) == _ids(upto) and t["complete"]
    assert t["n_tokens"] == kept[1]["n_tokens"] == int(_attr(d, "info", "data-n-tokens") or -1)
    # the page shows the inherited history as the parent's
    assert _versions(d, f'#transcript .seg[data-session="{sid}"]') == [0, 1]
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 2  # the parent is untouched


def test_roll_back_to_here(browser, server, http):
    sid = _new_session(http)
    _continue(http, sid, "\nJULIET:")
    _continue(http, sid, "\nROMEO:")
    kept = {v["version"]: v for v in http.get(f"/v1/sessions/{sid}/versions").json()["versions"]}

    d = browser
    _open(d, server, sid)
    # rolling back to the current version would change nothing
    assert _attrs(d, '#versions li[data-version="2"] button.rollback-here', "disabled") == [""]  # (present)
    _click(d, '#versions li[data-version="1"] button.rollback-here')
    _wait(d, lambda _: _attr(d, "info", "data-version") == "3")
    _shown(d, sid)
    s = http.get(f"/v1/sessions/{sid}").json()
    assert s["version"] == 3 and s["n_tokens"] == kept[1]["n_tokens"]
    assert _attr(d, "info", "data-n-tokens") == str(kept[1]["n_tokens"])
    t = http.get(f"/v1/sessions/{sid}/transcript").json()
    assert _ids(t["segments"]) == _ids([seg for seg in t["segments"] if seg["version"] <= 1])
    assert d.find_elements("css selector", '#transcript .seg[data-version="3"][data-kind="rollback"]')


def test_download_then_upload_makes_a_session_with_the_same_tokens(browser, server, http, downloads):
    sid = _new_session(http)
    _continue(http, sid, "\nJULIET:")
    d = browser
    _open(d, server, sid)
    d.find_element("id", "download").click()
    _wait(d, lambda _: _attr(d, "download", "data-file") or "error" in _status(d))
    name = _attr(d, "download", "data-file")
    assert name == f"{sid}.v1.state", _status(d)
    path = downloads / name
    _wait(d, lambda _: path.exists() and not (downloads / (name + ".crdownload")).exists())
    blob = path.read_bytes()
    assert blob == http.get(f"/v1/sessions/{sid}/state").content  # what the server exported

    d.find_element("id", "upload-file").send_keys(str(path))
    d.find_element("id", "upload").click()
    _wait(d, lambda _: _attr(d, "info", "data-id") not in (None, sid) or "error" in _status(d))
    new = _attr(d, "info", "data-id")
    assert new not in (None, sid), _status(d)
    assert new is not None
    _shown(d, new)
    s, n = http.get(f"/v1/sessions/{sid}").json(), http.get(f"/v1/sessions/{new}").json()
    assert n["n_tokens"] == s["n_tokens"] and n["version"] == 0
    assert _attr(d, "info", "data-n-tokens") == str(s["n_tokens"])
    assert _attr(d, "transcript", "data-complete") == "false"  # an import's history is unknown
    assert d.find_elements("css selector", f'#sessions button[data-id="{new}"]')


def test_stop_keeps_what_was_streamed(browser, server, http):
    sid = _new_session(http)
    d = browser
    _open(d, server, sid)
    _set(d, "prompt", "\nJULIET:")
    _set(d, "max-tokens", "50000")
    _set(d, "temperature", "0")
    d.find_element("id", "generate").click()
    _wait(
        d,
        lambda _: (
            int(_attr(d, "output", "data-received") or 0) >= 5
            or _attr(d, "output", "data-state") != "streaming"
        ),
    )
    assert _attr(d, "output", "data-state") == "streaming", _status(d)
    stop = d.find_element("id", "stop")
    assert stop.is_enabled()
    stop.click()
    _wait(d, lambda _: _attr(d, "output", "data-state") == "stopped")
    assert _attr(d, "output", "data-kept") == "true", _status(d)
    received = int(_attr(d, "output", "data-received") or 0)
    text = _attr(d, "output", "data-text") or ""
    _shown(d, sid)

    # the session holds the tokens streamed: a `keep` commit of the prompt and at least what
    # the page received (the server may have sent a few more before it saw the hang-up)
    s = http.get(f"/v1/sessions/{sid}").json()
    t = http.get(f"/v1/sessions/{sid}/transcript").json()
    seg = t["segments"][-1]
    assert s["version"] == 1 and seg["version"] == 1 and seg["kind"] == "keep"
    sampled = [i for i, m in zip(seg["ids"], seg["sampled"], strict=True) if m]
    assert received <= len(sampled) < 50000
    assert s["n_tokens"] == 7 + len("\nJULIET:") + len(sampled)
    kept_text = http.post("/detokenize", json={"tokens": sampled}).json()["prompt"]
    assert kept_text.startswith(text) and len(text) > 0
    # and the page shows where it stopped: after the kept version's last token
    mark = d.find_element("id", "stopped-at")
    assert mark.get_attribute("data-version") == "1"
    assert mark.find_element("xpath", "..").get_attribute("data-version") == "1"
    assert _attr(d, "info", "data-n-tokens") == str(s["n_tokens"])
    # the session takes a write again (the stopped generation released its lock)
    until = time.monotonic() + 30
    while http.post(f"/v1/sessions/{sid}/score", json={"prompt": "x", "commit": False}).status_code != 200:
        assert time.monotonic() < until, "the stopped generation still holds the session"
        time.sleep(0.1)
