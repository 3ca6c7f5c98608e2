"""Prometheus collector for the uplink scheduler's per-band counters (``/metrics``).

Register next to the sidecar's metrics::

    registry.register(UplinkCollector(uplink))

Series (bounded labels: ``band`` is ``0`` .. ``6`` for HTB, ``0``/``1`` for pfifo_fast, ``app``
for the application-level scheduler)::

    overtake_uplink_bytes_total{band}          bytes handed to the socket while in that band
    overtake_uplink_flows_total{band}          responses opened in that band
    overtake_uplink_active_flows{band}         responses currently in that band (incl. draining)
    overtake_uplink_priority_changes_total     SO_PRIORITY changes after the first
    overtake_uplink_turn_waits_total{band}     responses that waited for a write turn in an
                                               ordered band (``--uplink-lowest-writers``; only
                                               the bands it orders)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from overtake.controller.uplink.app import AppUplink
from overtake.controller.uplink.kernel import KernelUplink

__all__ = ["UplinkCollector"]


class UplinkCollector(Collector):
    """Reads the uplink's counters at every scrape (nothing is copied in the hot path)."""

    def __init__(self, uplink: Any) -> None:
        self._up = uplink

    def collect(self) -> Iterator[Metric]:
        up = self._up
        b = CounterMetricFamily("overtake_uplink_bytes", "Response bytes written per uplink band",
                                labels=["band"], unit="")  # fmt: skip
        f = CounterMetricFamily("overtake_uplink_flows", "Responses opened per uplink band",
                                labels=["band"])  # fmt: skip
        a = GaugeMetricFamily("overtake_uplink_active_flows",
                              "Responses currently in each uplink band", labels=["band"])  # fmt: skip
        c = CounterMetricFamily("overtake_uplink_priority_changes",
                                "SO_PRIORITY changes after a response's first band")  # fmt: skip
        if isinstance(up, KernelUplink):
            st = up.stats()
            for band in range(len(up.bandmap.data)):
                key = str(band)
                b.add_metric([key], st.bytes_written.get(band, 0))
                f.add_metric([key], st.flows_opened.get(band, 0))
                a.add_metric([key], max(st.active.get(band, 0), 0))
            c.add_metric([], st.priority_changes)
            w = CounterMetricFamily("overtake_uplink_turn_waits",
                                    "Times a response waited for a write turn in an ordered band",
                                    labels=["band"])  # fmt: skip
            for band in up.ordered:
                w.add_metric([str(band)], st.turn_waits.get(band, 0))
            yield w
        elif isinstance(up, AppUplink):
            b.add_metric(["app"], up.bytes_written)
            c.add_metric([], 0)
        else:
            c.add_metric([], 0)
        yield from (b, f, a, c)
