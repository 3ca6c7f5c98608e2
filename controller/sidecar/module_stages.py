"""Module mode: do the stages file and Apache's ``OvertakeStage`` sections describe one tandem?

A transaction's link between stages is configured twice in module mode: the stages file's
``next:`` (the model the sidecar fits and solves) and Apache's ``OvertakeStageNext`` (the
follow-up reservation the module makes). mod_overtake_prio publishes each stage it has, with the
stage its ``OvertakeStageNext`` names, as ``overtake_stage_next{stage,next}`` on
``/overtake-prio-status``; :class:`ModuleStageCheck` compares them with the stages file after every
read of that page, logs each difference once (``module_stage_mismatch``) and agreement once
(``module_stages_agree``), shows them in ``/-/policy`` (``module_stages``) and exports
``overtake_module_stage_mismatch{stage}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["ModuleStageCheck", "StageDiff", "compare_stages", "module_stage_rows", "parse_module_stages"]

log = logging.getLogger("overtake.sidecar")

#: the status page's family of stage rows (absent from a module built before it published them)
ROWS = "overtake_stage_next"

#: stage -> the stage its link names (None: no link)
Links = Mapping[str, str | None]


@dataclass(frozen=True)
class StageDiff:
    """One difference between the stages file and the module, for one stage.

    ``kind``: ``missing_in_module`` (no ``OvertakeStage`` of that name in Apache),
    ``missing_in_stages_file`` (Apache holds a stage the stages file does not name) or ``next``
    (the two name different next stages). ``stages_file`` / ``module``: each side's ``next``
    (None: no link, or the stage is absent from that side).
    """

    stage: str
    kind: str
    stages_file: str | None
    module: str | None
    fix: str

    def message(self) -> str:
        if self.kind == "missing_in_module":
            return f"stage {self.stage!r} is in the stages file but Apache has no OvertakeStage {self.stage}"
        if self.kind == "missing_in_stages_file":
            return f"Apache holds stage {self.stage!r} (OvertakeStage {self.stage}) but the stages file has no such stage"
        return (f"stage {self.stage!r}: the stages file's next is {_show(self.stages_file)} but Apache's "
                f"OvertakeStageNext is {_show(self.module)}")


def _show(v: str | None) -> str:
    return "none" if v is None else repr(v)


def module_stage_rows(families: Iterable[Metric]) -> dict[str, str | None] | None:
    """The module's stages and their ``OvertakeStageNext`` from its parsed status page; None when
    the page has no stage rows (a module without them, or the page not read)."""
    for f in families:
        if f.name == ROWS:
            return {s.labels["stage"]: s.labels.get("next") or None for s in f.samples if "stage" in s.labels}
    return None


def parse_module_stages(text: str) -> dict[str, str | None] | None:
    """:func:`module_stage_rows` of the status page's text."""
    return module_stage_rows(text_string_to_metric_families(text))


def _fix_next(stage: str, want: str | None, have: str | None) -> str:
    if want is None:
        return (f"remove 'OvertakeStageNext {stage} {have}' from Apache's config, or add 'next: {have}' to stage "
                f"{stage} in the stages file")
    if have is None:
        return (f"add 'OvertakeStageNext {stage} {want}' to Apache's config (then reload Apache), or remove "
                f"'next: {want}' from stage {stage} in the stages file")
    return (f"make them agree: 'OvertakeStageNext {stage} {want}' in Apache's config (then reload Apache), or "
            f"'next: {have}' for stage {stage} in the stages file")


def compare_stages(stages_file: Links, module: Links) -> list[StageDiff]:
    """The differences between the stages file's stages and ``next`` and the module's, in the stages
    file's order, then the module's extra stages."""
    out: list[StageDiff] = []
    for name, want in stages_file.items():
        if name not in module:
            out.append(StageDiff(name, "missing_in_module", want, None, (
                f"add OvertakeStagePrefix PATH {name} (server level, per path prefix of the stage) or an "
                f"OvertakeStage {name} section (<Location> or <LocationMatch> of its paths) to Apache's "
                f"config, or remove stage {name} from the stages file")))
        elif module[name] != want:
            out.append(StageDiff(name, "next", want, module[name], _fix_next(name, want, module[name])))
    for name, have in module.items():
        if name not in stages_file:
            out.append(StageDiff(name, "missing_in_stages_file", None, have, (
                f"add a stage named {name} to the stages file (stages: - name: {name}), or remove Apache's "
                f"OvertakeStage {name}")))
    return out


class ModuleStageCheck(Collector):
    """Compares the stages file (``expected``, read at each check: a reload may change it) with the
    module's stage rows after every read of its status page.

    Parameters
    ----------
    expected
        The stages file's stages in order, each with its ``next`` (None: no link).
    """

    def __init__(self, expected: Callable[[], Links]) -> None:
        self.expected = expected
        self.module: dict[str, str | None] | None = None
        self.diffs: list[StageDiff] = []
        self._seen: tuple[tuple[tuple[str, str | None], ...], tuple[tuple[str, str | None], ...]] | None = None
        self._logged: set[StageDiff] = set()
        self._said_agree = False
        self._said_no_rows = False

    def update(self, families: list[Metric]) -> None:
        """Check the module's rows in ``families`` (a fresh read of its status page) when they or the
        stages file changed since the last check; log what is new."""
        rows = module_stage_rows(families)
        if rows is None:
            if families and not self._said_no_rows:  # the page was read, but without stage rows
                self._said_no_rows = True
                log.warning("mod_overtake_prio publishes no stage rows: the stages file's stages and next are not "
                            "checked against Apache's OvertakeStage/OvertakeStageNext", extra={
                                "event": "module_stages_unknown", "detail": f"no {ROWS} on /overtake-prio-status; "
                                "rebuild and reinstall mod_overtake_prio (apache-conf/mod_overtake_prio/README.md)"})
            return
        want = dict(self.expected())
        key = (tuple(want.items()), tuple(rows.items()))
        if key == self._seen:
            return
        self._seen, self.module = key, rows
        self.diffs = compare_stages(want, rows)
        for d in self.diffs:
            if d not in self._logged:
                self._logged.add(d)
                log.warning(d.message(), extra={"event": "module_stage_mismatch", "stage": d.stage, "detail": {
                    **asdict(d), "fix": d.fix}})
        if self.diffs:
            self._said_agree = False
        elif not self._said_agree:
            self._said_agree = True
            log.info("the stages file's stages and next agree with Apache's OvertakeStage/OvertakeStageNext",
                     extra={"event": "module_stages_agree", "detail": {"stages": rows}})

    def info(self) -> dict[str, Any]:
        """``module_stages`` of ``GET /-/policy``: ``agree`` is None until the module's rows are read."""
        return {"agree": None if self.module is None else not self.diffs,
                "stages_file": dict(self.expected()), "module": self.module,
                "differences": [asdict(d) for d in self.diffs]}

    def collect(self) -> Iterator[Metric]:
        if self.module is None:
            return
        g = GaugeMetricFamily("overtake_module_stage_mismatch",
                              "1 if the stage's next (or the stage itself) differs between the stages file and "
                              "Apache's OvertakeStage/OvertakeStageNext, else 0", labels=["stage"])
        bad = {d.stage for d in self.diffs}
        expected = dict(self.expected())
        names = list(expected) + [s for s in self.module if s not in expected]
        for s in names:
            g.add_metric([s], 1.0 if s in bad else 0.0)
        yield g
