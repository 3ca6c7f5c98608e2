"""The metrics reference names every series the sidecar, its online loop, the uplink and the API
define: each metric family constructed in controller/ and api/ (prometheus_client's ``Counter``,
``Gauge``, ``Histogram``, ``Summary``, ``Info`` and the ``*MetricFamily`` of custom collectors, a
counter under its exposed ``_total`` name) appears in docs/reference/metrics.md. A series added
without a line for its users fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r'\b(Counter|Gauge|Histogram|Summary|Info)(?:MetricFamily)?\(\s*f?"([a-z_]+)"')


def defined() -> dict[str, str]:
    """Exposed series name -> the file that defines it."""
    out = {}
    for f in sorted([*(ROOT / "controller").rglob("*.py"), *(ROOT / "api").rglob("*.py")]):
        for kind, name in DEFINITION.findall(f.read_text(encoding="utf-8")):
            exposed = f"{name}_total" if kind == "Counter" and not name.endswith("_total") else name
            out[exposed] = str(f.relative_to(ROOT))
    return out


def test_the_definitions_are_found() -> None:
    names = defined()
    assert len(names) >= 60
    assert {"overtake_stage_queued", "overtake_stage_admitted_total", "apache_up", "overtake_api_jobs"} <= set(names)


def test_the_reference_names_every_series() -> None:
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    missing = {n: f for n, f in defined().items() if not re.search(rf"`{re.escape(n)}[`{{]", text)}
    assert not missing, f"docs/reference/metrics.md names no {missing}"
