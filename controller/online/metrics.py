"""``overtake_online_*`` Prometheus metrics of the online loop (list: :mod:`overtake.controller.sidecar.metrics`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from overtake.controller.online.loop import OnlineLoop
from overtake.controller.online.settings import SOURCES

__all__ = ["OnlineCollector"]


@dataclass(eq=False)  # the registry keys collectors by identity
class OnlineCollector(Collector):
    """``overtake_online_*`` metrics, read from the loop at scrape time."""

    loop: OnlineLoop

    def collect(self) -> Iterator[Metric]:
        lp = self.loop
        refits = CounterMetricFamily("overtake_online_refits", "Online refit attempts by outcome", labels=["outcome"])
        for k, v in lp.outcomes.items():
            refits.add_metric([k], v)
        yield refits
        cpu = CounterMetricFamily("overtake_solve_cpu_seconds", "CPU seconds (user + system) of the online "
                                  "refit jobs (fit, solve, evaluation) in the nice 19 worker, by kind of solve",
                                  labels=["kind"])
        for kind, sec in sorted(lp.solve_cpu.items()):
            cpu.add_metric([kind], sec)
        yield cpu
        yield GaugeMetricFamily("overtake_online_generation", "Policies swapped in by the online loop", value=lp.generation)
        if lp.last_refit_time is not None:
            yield GaugeMetricFamily("overtake_online_last_refit_timestamp_seconds",
                                    "Unix time of the last refit decision (swapped, kept, failed or skipped)",
                                    value=lp.last_refit_time)
        rec = lp.recorder
        lam = rec.arrival_rate()
        if lam is not None:
            yield GaugeMetricFamily("overtake_online_arrival_rate_per_second",
                                    "Estimated transaction arrival rate (first stage) over the arrival window",
                                    value=lam)
        samples = GaugeMetricFamily("overtake_online_demand_samples", "Service-demand samples held per stage and source",
                                    labels=["stage", "source"])
        observed = CounterMetricFamily("overtake_online_demand_observations", "Service-demand samples recorded",
                                       labels=["stage", "source"])
        mean = GaugeMetricFamily("overtake_online_demand_mean_seconds",
                                 "Mean of the held service-demand samples (compare the two sources)",
                                 labels=["stage", "source"])
        for name, st in zip(lp.names, rec.stages):
            for src in SOURCES:
                r = st.reservoirs[src]
                samples.add_metric([name, src], len(r))
                observed.add_metric([name, src], st.observed[src])
                if r:
                    mean.add_metric([name, src], sum(r) / len(r) * lp.time_unit)
        yield samples
        yield observed
        yield mean
        if rec.tail is not None:
            lines = CounterMetricFamily("overtake_online_log_lines", "Access-log lines of each stage read (every "
                                        "answer; in module mode each is an arrival)", labels=["stage"])
            none = CounterMetricFamily("overtake_online_log_lines_without_demand", "Access-log lines of each stage "
                                       "answered 200 that gave no service demand (no CPU note, or the stage's "
                                       "work runs behind PHP-FPM or a proxy)", labels=["stage"])
            for name in lp.names:
                lines.add_metric([name], rec.tail.lines[name])
                none.add_metric([name], rec.tail.no_demand[name])
            yield lines
            yield none
            yield CounterMetricFamily("overtake_online_log_lines_unparsed", "Access-log lines in no format the "
                                      "sidecar reads (overtake.controller.log_format)", value=rec.tail.bad_lines)
        if lp.lock_watch is not None:
            yield from _serialisation(lp)
        last = lp.last
        if "fit" in last:
            unit = last.get("time_unit", lp.time_unit)  # the unit the refit ran in
            fm = GaugeMetricFamily("overtake_online_fitted_mean_seconds", "Mean service demand of the last fit",
                                   labels=["stage", "source"])
            for f in last["fit"]:
                fm.add_metric([f["name"], last["source"][f["name"]]], f["mean"] * unit)
            yield fm
            pw = GaugeMetricFamily("overtake_online_predicted_response_time_seconds",
                                   "Model E[W] under the last refitted model", labels=["policy"])
            for k in ("current", "new"):
                w = last[f"predicted_{k}"]
                pw.add_metric([k], w * unit if math.isfinite(w) else math.inf)
            yield pw
            yield GaugeMetricFamily("overtake_online_refit_duration_seconds", "Wall time of the last refit job",
                                    value=last["seconds"])


def _serialisation(lp: OnlineLoop) -> Iterator[Metric]:
    """The lock watch's verdict per stage (controller.online.lockwatch)."""
    assert lp.lock_watch is not None
    ser = GaugeMetricFamily("overtake_stage_serialised", "1 when the stage's requests block only beside "
                            "requests of the same stage (a lock), 0 otherwise or undecided", labels=["stage"])
    cap = GaugeMetricFamily("overtake_stage_serialised_capacity", "Requests of the stage that progress together at "
                            "most (the serialising lock's holders), while the stage is serialised", labels=["stage"])
    for name in lp.names:
        v = lp.lock_watch.verdicts.get(name)
        ser.add_metric([name], 1.0 if v is not None and v.serialising else 0.0)
        if v is not None and v.lock_capacity is not None:
            cap.add_metric([name], float(v.lock_capacity))
    yield ser
    yield cap
