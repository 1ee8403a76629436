"""The playground page (`GET /`) in a real headless Chromium, driven with Selenium and the
system chromedriver: create a session, stream a generation through EventSource, fork and
delete; and the GET streaming route it uses."""

from __future__ import annotations

import shutil
import tempfile

import httpx
import pytest

from .sse_client import events

SERVER_SETTINGS = {"max_tokens": 100_000}  # so a generation is still running when Stop is clicked
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "NO BROWSER: Debian's chromium and chromium-driver are not installed, so the playground "
            "is NOT tested. Install them: apt-get install -y chromium chromium-driver (.ci/run does)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="recur-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, predicate, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d))


def _set(driver, element_id: str, value: str) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(value)


def test_page_is_self_contained(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "EventSource" in r.text
    # nothing is fetched from anywhere else: no external URL, and a CSP that forbids it
    assert "http://" not in r.text and "https://" not in r.text and "//cdn" not in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]


def test_get_generate_streams_like_post(http):
    a = http.post("/v1/sessions", json={"prompt": "Once"}).json()["id"]
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


def test_click_through_create_generate_fork_delete(browser, server, http):
    d = browser
    d.get(server.url + "/")
    _set(d, "new-prompt", "ROMEO:")
    d.find_element("id", "create").click()
    info = d.find_element("id", "info")
    _wait(d, lambda _: info.get_attribute("data-id"))
    sid = info.get_attribute("data-id")
    assert info.get_attribute("data-version") == "0" and info.get_attribute("data-n-tokens") == "7"

    _set(d, "prompt", "\nJULIET:")
    _set(d, "max-tokens", "24")
    _set(d, "temperature", "0")
    d.find_element("id", "generate").click()
    output = d.find_element("id", "output")
    _wait(d, lambda _: output.get_attribute("data-state") in ("done", "error"))
    assert output.get_attribute("data-state") == "done", d.find_element("id", "status").text
    streamed = output.get_attribute("textContent")

    # the page shows what the server committed
    s = http.get(f"/v1/sessions/{sid}").json()
    assert s["version"] == 1 and s["n_tokens"] == 1 + 6 + 8 + 24
    assert info.get_attribute("data-version") == "1" and info.get_attribute("data-n-tokens") == str(
        s["n_tokens"]
    )
    # and the streamed text is what the session generated: the same greedy turn on a twin
    twin = http.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    r = http.post(
        f"/v1/sessions/{twin}/generate",
        json={"prompt": "\nJULIET:", "max_tokens": 24, "temperature": 0, "stream": False},
    )
    assert streamed == r.json()["text"]
    assert len(streamed) > 0

    d.find_element("id", "fork").click()
    _wait(d, lambda _: info.get_attribute("data-id") not in (None, sid))
    fork = info.get_attribute("data-id")
    f = http.get(f"/v1/sessions/{fork}").json()
    assert f["n_tokens"] == s["n_tokens"] and f["version"] == 0

    d.find_element("id", "delete").click()
    _wait(d, lambda _: "deleted" in d.find_element("id", "status").text)
    assert http.get(f"/v1/sessions/{fork}").status_code == 404
    assert http.get(f"/v1/sessions/{sid}").status_code == 200
    ids = [li.get_attribute("data-id") for li in d.find_elements("css selector", "#sessions li")]
    assert sid in ids and fork not in ids

    # Stop: closing the EventSource mid-stream commits nothing
    d.find_elements("css selector", f'#sessions li[data-id="{sid}"]')[0].click()
    _wait(d, lambda _: info.get_attribute("data-id") == sid)
    _set(d, "max-tokens", "50000")
    d.find_element("id", "generate").click()
    _wait(
        d,
        lambda _: (
            len(output.get_attribute("textContent")) >= 5 or output.get_attribute("data-state") != "streaming"
        ),
    )
    stop = d.find_element("id", "stop")
    assert output.get_attribute("data-state") == "streaming", d.find_element("id", "status").text
    assert stop.is_enabled()
    stop.click()
    _wait(d, lambda _: output.get_attribute("data-state") != "streaming", timeout=10)
    assert output.get_attribute("data-state") == "stopped", d.find_element("id", "status").text
    assert _wait(d, lambda _: _unlocked(http, sid), timeout=30)
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 1


def _unlocked(http: httpx.Client, sid: str) -> bool:
    """The session takes a write again (the abandoned generation released its lock)."""
    r = http.post(f"/v1/sessions/{sid}/score", json={"prompt": "x", "commit": False})
    return (
        r.status_code == 200
        and http.delete(f"/v1/sessions/{sid}", headers={"If-Match": '"999"'}).status_code == 412
    )
