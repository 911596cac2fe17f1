"""The dashboard page in a real headless Chromium: it renders the islands table, the loss,
staleness and compute charts from the server's history, marks a stuck island and the
islands that left, shows the event feed, and refreshes by itself."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import time

import pytest

from archipelago.api.app import create_app
from tests.conftest import REPO
from tests.fake_handle import FakeRun
from tests.http_server import serving

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium(url: str, tmp_path, *extra: str, virtual_ms: int = 6000) -> str:
    """What Chromium printed after `virtual_ms` of the page's (virtual) time: the page
    polls every 2,000 ms, so under that it had only its first load."""
    out = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--virtual-time-budget={virtual_ms}",
            *extra,
            url,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return out.stdout


def _series(dom: str, chart: str) -> dict[str, str]:
    """The paths of one chart's series: {series: its `d`}."""
    svg = dom[dom.index(f'id="{chart}"') :]
    svg = svg[: svg.index("</svg>")]
    return dict(re.findall(r'class="series" data-series="([^"]+)" d="([^"]+)"', svg))


def test_dashboard_renders_live_data(tmp_path):
    run = FakeRun(islands=3)
    with serving(create_app(run, None)) as url:
        dom = _chromium(url + "/", tmp_path, "--dump-dom")
        _chromium(url + "/", tmp_path, f"--screenshot={tmp_path / 'dashboard.png'}", "--window-size=1400,1000")
    assert "mode diloco" in dom and "round 3/10" in dom and "eval loss 2.2500" in dom
    assert sorted(re.findall(r'<tr data-island="(\d+)"', dom)) == ["0", "1", "2"]
    assert list(_series(dom, "loss")) == ["eval"]
    assert sorted(_series(dom, "staleness")) == ["0", "1", "2"]
    # the script ran under the page's Content-Security-Policy (pinned by hash), legend included
    assert re.findall(r'<span class="present" data-island="(\d+)">', dom) == ["0", "1", "2"]
    for label in ("eval loss", "versions behind", "seconds computing", "round"):  # labelled axes
        assert re.search(f'<text class="axis"[^>]*>{label}</text>', dom), label
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    artifacts = REPO / "test-artifacts"  # kept for people and CI logs to look at
    artifacts.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "dashboard.png", artifacts / "dashboard.png")


def test_a_reload_shows_the_runs_history_a_stuck_island_and_the_departed_within_one_poll(tmp_path):
    """The page opened fresh (a new browser profile) on a run at round 12, given less
    virtual time than one poll: the history comes from the server's records, not from
    what an earlier tab sampled; island 2 has had work out for 10 minutes with no news
    (its round of work is 50 steps at 8 steps/s: stuck after 5 × 6.25 s = 31 s); island 3
    died at round 6 and is marked as gone, its history kept; the event feed shows why."""
    run = FakeRun(islands=4)
    run.round = 12
    now = time.time()
    run.isl["2"].update(steps_per_s=8.0, inner_steps=50, last_progress=now - 600, last_contribution=now - 620)
    run.isl["3"].update(state="dead", merge="training", last_progress=now - 400, error="node lost")
    run.left["3"] = 6
    run.log += [
        {"time": now - 620, "kind": "late", "island": 2, "deadline_s": 9.5},
        {"time": now - 400, "kind": "crash", "island": 3, "reason": "node lost"},
    ]
    with serving(create_app(run, None)) as url:
        dom = _chromium(url + "/", tmp_path, "--dump-dom", virtual_ms=1500)
        _chromium(url + "/", tmp_path, f"--screenshot={tmp_path / 'stuck.png'}", "--window-size=1400,1100")
    staleness, compute = _series(dom, "staleness"), _series(dom, "compute")
    # the whole history at the first poll: 12 rounds for the islands still there, 6 for island 3
    assert {i: d.count("L") + 1 for i, d in staleness.items()} == {"0": 12, "1": 12, "2": 12, "3": 6}
    assert {i: d.count("L") + 1 for i, d in compute.items()} == {"0": 11, "1": 11, "2": 11, "3": 5}
    # each island's colour is its own, the same on every load: a hue from its id
    strokes = dict(re.findall(r'data-series="(\d)" d="[^"]+" fill="none" stroke="([^"]+)"', dom))
    assert len(set(strokes.values())) == 4 and strokes["1"] == "hsl(137.508, 65%, 42%)"
    row = re.search(r'<tr data-island="2" class="([^"]*)">(.*?)</tr>', dom, re.S)
    assert row.group(1) == "stuck" and "STUCK: no news for 10 min" in row.group(2)
    assert re.search(r'<div class="stuck" data-island="2">island 2 \(node-a:cpu\) is stuck', dom)
    assert re.search(r'<tr data-island="3" class="gone">', dom)  # dead: no longer working, never "stuck"
    assert re.search(r'<tr data-island="[01]" class="stuck"', dom) is None
    assert re.findall(r'<span class="(present|departed)" data-island="3">', dom) == ["departed"]
    assert "island 3 (left)" in dom
    assert re.findall(r'<tr data-event="(\w+)">', dom) == ["crash", "late"]  # newest first
    assert "reason=node lost" in dom
    shutil.copy(tmp_path / "stuck.png", REPO / "test-artifacts" / "dashboard-stuck.png")


def test_text_from_the_run_is_shown_as_text_never_as_markup(tmp_path):
    """Before: island node and state went into innerHTML unescaped (a node name could run
    script). The state is an `IslandState` now (a typed view cannot carry markup there); the
    free text an island reports, its node and its error, is escaped."""
    run = FakeRun(islands=2)
    run.isl["1"]["node"] = "<img src=x onerror=\"document.title='pwned'\">"
    run.isl["1"]["error"] = '"><b>raised</b>'
    with serving(create_app(run, None)) as url:
        dom = _chromium(url + "/", tmp_path, "--dump-dom")
    table = dom[dom.index('<table id="islands"') :]
    assert "<img" not in table and "<b>" not in table
    assert "&lt;img src=x onerror=" in table and "&lt;b&gt;raised&lt;/b&gt;" in table
    assert "pwned" not in dom[: dom.index("<body")]  # the title was never rewritten


class DevTools:
    """Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
    commands in on its fd 3, answers and events out on its fd 4, each message ended by a
    NUL), so a test types and presses keys as a person does; no client library needed."""

    def __init__(self, tmp_path) -> None:
        into, self._to = os.pipe()  # what Chromium reads (its fd 3)
        self._from, out = os.pipe()  # what it writes (its fd 4)

        # the pipes put at the numbers Chromium reads by bash, which then becomes it (not
        # a `preexec_fn`: unsafe beside the test server's threads)
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{into} 4>&{out}', "chromium", CHROMIUM, *FLAGS,
             f"--user-data-dir={tmp_path / 'profile'}", "--remote-debugging-pipe", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(into, out),
        )  # fmt: skip
        os.close(into)
        os.close(out)
        self._buffer, self._id, self.session = b"", 0, None
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise

    def call(self, method: str, **params) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:  # events are skipped: the test asks for the page's state itself
            while b"\0" not in self._buffer:
                ready, _, _ = select.select([self._from], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"Chromium did not answer {method} in 30 s"
                chunk = os.read(self._from, 1 << 16)
                assert chunk, "Chromium closed its DevTools pipe"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._id:
                assert "error" not in answer, answer
                return answer["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def until(self, expression: str, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"never true: {expression}"
            time.sleep(0.1)
        return value

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self._to)
        os.close(self._from)


def test_a_control_plane_with_a_token_asks_for_it_and_shows_the_run_once_it_is_typed(tmp_path):
    """The token is typed into the page's form, not carried by the URL: a link or a fragment
    is kept in the browser's history, which outlives the tab. Before, `/#token=…` was read
    (and the address bar cleared after the visit was recorded)."""
    token = "dashboard-token-0123456789"
    with serving(create_app(FakeRun(islands=2), token)) as url:
        page = DevTools(tmp_path)
        try:
            page.call("Page.navigate", url=f"{url}/#token={token}")  # the old way: ignored now
            page.until("!document.getElementById('login').hidden")
            assert "needs the API token" in page.js("document.body.innerText")
            assert page.js("document.querySelectorAll('tr[data-island]').length") == 0
            page.js("document.getElementById('token').focus()")
            page.call("Input.insertText", text=token)
            for kind in ("keyDown", "keyUp"):  # Enter in the field submits the form
                page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                          text="\r")  # fmt: skip
            page.until("document.querySelectorAll('tr[data-island]').length === 2")
            assert "mode diloco" in page.js("document.body.innerText")
            assert page.js("document.getElementById('login').hidden")
            assert page.js("sessionStorage.getItem('archipelago-token')") == token  # this tab's only
        finally:
            page.close()
