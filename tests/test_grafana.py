"""The Grafana dashboard in k8s/ queries metrics the code really publishes."""

from __future__ import annotations

import json
import re

from archipelago.orchestrator.engine.state.views import HISTOGRAMS, ISLAND_METRICS, ISLAND_STATE, RUN_METRICS
from tests.conftest import REPO


def test_every_panel_queries_a_published_metric():
    dash = json.loads((REPO / "k8s" / "grafana-dashboard.json").read_text())
    published = {f"ray_{m.name}" for m in [*RUN_METRICS, *ISLAND_METRICS, ISLAND_STATE]}
    published |= {f"ray_{m.name}_bucket" for m in HISTOGRAMS}
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"ray_archipelago_[a-z_]+", target["expr"]))
    assert used and used <= published, used - published
    assert any("staleness" in p["title"].lower() for p in dash["panels"])
    assert {f"ray_{m.name}_bucket" for m in HISTOGRAMS} <= used  # the distributions are shown
