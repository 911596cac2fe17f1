"""The dashboard page in a real headless Chromium: it renders the islands table, the loss
chart and one staleness series per island, and refreshes by itself."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from api.app import create_app
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


def _chromium(url: str, tmp_path, *extra: str) -> str:
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=6000", *extra, url],
        check=False,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return out.stdout


def test_dashboard_renders_live_data(tmp_path):
    run = FakeRun(islands=3)
    with serving(create_app(run, None)) as url:
        dom = _chromium(url + "/", tmp_path, "--dump-dom")
        _chromium(url + "/", tmp_path, f"--screenshot={tmp_path / 'dashboard.png'}", "--window-size=1100,800")
    assert "mode diloco" in dom and "round 3/10" in dom and "eval loss 2.2500" in dom
    assert sorted(re.findall(r'data-island="(\d+)"', dom)) == ["0", "1", "2"]
    assert len(re.findall(r'class="series" data-series="eval"', dom)) == 1
    staleness_series = re.findall(r'class="series" data-series="(\d+)"', dom)
    assert sorted(set(staleness_series)) == ["0", "1", "2"]
    # the script ran under the page's Content-Security-Policy (pinned by hash), legend included
    assert re.findall(r'<span class="(c\d)">■ island', dom) == ["c0", "c1", "c2"]
    # the page refreshed several times within the virtual time budget: the staleness paths have several points
    path = re.search(r'data-series="2" d="([^"]+)"', dom).group(1)
    assert path.count("L") >= 2
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    artifacts = REPO / "test-artifacts"  # kept for people and CI logs to look at
    artifacts.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "dashboard.png", artifacts / "dashboard.png")


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


def test_a_control_plane_with_a_token_asks_for_it_and_shows_the_run_with_it(tmp_path):
    token = "dashboard-token-0123456789"
    with serving(create_app(FakeRun(islands=2), token)) as url:
        without = _chromium(url + "/", tmp_path, "--dump-dom")
        with_token = _chromium(f"{url}/#token={token}", tmp_path, "--dump-dom")
    assert "needs the API token" in without and 'data-island="0"' not in without
    assert "mode diloco" in with_token and sorted(re.findall(r'data-island="(\d+)"', with_token)) == ["0", "1"]
