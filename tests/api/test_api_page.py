"""The page at ``/``, rendered by headless Chromium (Debian ``chromium``) from a live ``overtake api``."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.api_helpers import exp2, live_api, wait

from overtake.api.db import Store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="Debian package chromium is not installed "
                                 "(apache-conf/install-debian-packages.sh installs it)"),
              pytest.mark.slow]  # a live API and a headless browser per test


class _Dom(HTMLParser):
    """Collects elements' attributes and the text of table cells from the dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        if data.strip():
            self.text.append(data.strip())


def _render(url: str, tmp: Path) -> _Dom:
    assert CHROMIUM is not None
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=10000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=True)
    dom = _Dom()
    dom.feed(out.stdout)
    return dom


def test_page_lists_models_with_rendered_figures(tmp_path: Path) -> None:
    with live_api(tmp_path / "page.db") as base:
        model = wait(httpx, base + httpx.post(base + "/v1/models", json=exp2(0.3), params={"name": "two exp stages"}, timeout=60)
                     .json()["url"])
        x = np.random.default_rng(1).exponential(0.2, 200).tolist()
        fit = wait(httpx, base + httpx.post(base + "/v1/fits", json={"samples": x, "order": 1, "name": "db"},
                                            timeout=60).json()["url"])
        assert model["status"] == "done" and fit["status"] == "done"
        # a failed job, as a worker records it
        store = Store(str(tmp_path / "page.db"))
        fid = store.create("model", "broken", {"scenario": exp2(0.5), "estimated_states": 1})
        store.start(fid)
        store.fail(fid, "SolverError: did not converge")
        failed = httpx.get(f"{base}/v1/models/{fid}").json()

        dom = _render(base + "/", tmp_path)

    body = next(a for t, a in dom.elements if t == "body")
    assert body.get("data-ready") == "yes", "the page's load handler did not run"
    rows = {a["data-id"]: a["data-status"] for t, a in dom.elements if t == "tr" and "data-id" in a}
    assert rows[model["id"]] == "done"
    assert rows[failed["id"]] == failed["status"]
    imgs = {a["src"]: a.get("data-loaded") for t, a in dom.elements if t == "img"}
    for kind in ("gains", "policy", "distributions"):
        assert imgs[f"/v1/models/{model['id']}/plots/{kind}.png"] == "yes", kind
    assert imgs[f"/v1/fits/{fit['id']}/plots/db.png"] == "yes"
    # a failed model shows its service distributions but no gains/policy figures
    assert f"/v1/models/{failed['id']}/plots/gains.png" not in imgs
    text = " ".join(dom.text)
    assert "SolverError: did not converge" in text
    assert "two exp stages" in text
    # the gains column shows each baseline's gain as the API computed it
    g = model["comparison"]["gains"]["pi(inf)"]
    assert f"pi(inf) {100 * g:+.2f}%" in text
    ew = model["metrics"]["mean_response_time"]
    assert f"{ew:.4f}" in text


def test_docs_render_offline_from_the_bundled_swagger_ui(tmp_path: Path) -> None:
    with live_api(tmp_path / "docs.db") as base:
        page = httpx.get(base + "/docs").text
        assert "/docs-static/swagger-ui-bundle.js" in page and "cdn" not in page
        dom = _render(base + "/docs", tmp_path)
    # Swagger UI fetched /openapi.json and rendered the operations (no network beyond loopback)
    paths = {a["data-path"] for _, a in dom.elements if "data-path" in a}
    assert {"/v1/models", "/v1/models/{model_id}/decision", "/v1/fits", "/healthz", "/metrics"} <= paths
    assert "Overtake" in dom.text
