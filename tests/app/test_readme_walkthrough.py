"""The README's curl walk-through ("A session, over HTTP"), run as pasted against a real
server: every command it shows works, and it does what its comments promise."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from tests.conftest import ROOT


def _walkthrough() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A session, over HTTP", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_readme_curl_walkthrough_works_as_pasted(server):
    assert shutil.which("curl"), "the README's walk-through is curl commands"
    script = _walkthrough()
    assert "B=http://127.0.0.1:8000\n" in script
    script = script.replace("B=http://127.0.0.1:8000", f"B={server.url}")
    # what it promises in its comments, each with its command
    for promise in ("/fork", "/rollback", "/versions", "/transcript"):
        assert f"$B/v1/sessions/$SID{promise}" in script, promise
    r = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # its last four commands answer one JSON object a line: fork, rollback, versions, transcript
    fork, rollback, versions, transcript = (json.loads(line) for line in r.stdout.splitlines()[-4:])
    assert "error" not in fork and fork["version"] == 0
    assert rollback["version"] == 3 and rollback["n_tokens"] == versions["versions"][1]["n_tokens"]
    assert [v["version"] for v in versions["versions"]] == [0, 1, 2, 3]
    assert [s["kind"] for s in transcript["segments"]][-1] == "rollback"
