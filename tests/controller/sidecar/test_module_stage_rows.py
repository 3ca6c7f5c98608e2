"""The module's stage rows (``overtake_stage_next``) as the sidecar reads them from a known
status page, and the comparison with the stages file's ``next`` (controller.sidecar.module_stages)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from overtake.controller.sidecar.module_stages import ModuleStageCheck, compare_stages, parse_module_stages

# the tail of /overtake-prio-status as mod_overtake_prio prints it for three stages, a -> b linked
PAGE = """# HELP overtake_cpu_prio_enabled 1 if this child demotes and restores worker threads (self-test passed).
# TYPE overtake_cpu_prio_enabled gauge
overtake_cpu_prio_enabled 1
# HELP overtake_stage_next 1 per OvertakeStage, labelled with the stage its OvertakeStageNext names (next="": none).
# TYPE overtake_stage_next gauge
overtake_stage_next{stage="a",next="b"} 1
overtake_stage_next{stage="b",next=""} 1
overtake_stage_next{stage="c",next=""} 1
# HELP overtake_stage_waiting Requests of the stage waiting for their turn.
# TYPE overtake_stage_waiting gauge
overtake_stage_waiting{stage="a"} 0
overtake_stage_waiting{stage="b"} 0
overtake_stage_waiting{stage="c"} 0
"""

OLD_PAGE = PAGE.split("# HELP overtake_stage_next")[0]  # a module that publishes no rows


def test_the_rows_of_a_known_page() -> None:
    assert parse_module_stages(PAGE) == {"a": "b", "b": None, "c": None}


def test_a_page_without_rows_is_unknown_not_empty() -> None:
    assert parse_module_stages(OLD_PAGE) is None


def test_differences_name_the_stage_and_both_values() -> None:
    module = {"a": "b", "b": None, "c": None}
    assert compare_stages({"a": "b", "b": None, "c": None}, module) == []
    (d,) = compare_stages({"a": "c", "b": None, "c": None}, module)
    assert (d.stage, d.kind, d.stages_file, d.module) == ("a", "next", "c", "b")
    assert "'c'" in d.message() and "'b'" in d.message() and "OvertakeStageNext a c" in d.fix
    (d,) = compare_stages({"a": None, "b": None, "c": None}, module)
    assert (d.kind, d.stages_file, d.module) == ("next", None, "b") and "OvertakeStageNext a b" in d.fix
    diffs = compare_stages({"a": "b", "b": None, "d": None}, module)
    assert [(d.stage, d.kind) for d in diffs] == [("d", "missing_in_module"), ("c", "missing_in_stages_file")]


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


def test_the_check_logs_each_difference_once_and_agreement_once(caplog: pytest.LogCaptureFixture) -> None:
    want: dict[str, str | None] = {"a": "c", "b": None, "c": None}
    check = ModuleStageCheck(lambda: want)
    fams = list(text_string_to_metric_families(PAGE))
    assert check.info()["agree"] is None
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        check.update(fams)
        check.update(fams)  # the same status again: nothing new
        (rec,) = _events(caplog, "module_stage_mismatch")
        assert rec.levelno == logging.WARNING and rec.__dict__["stage"] == "a"
        info = check.info()
        assert info["agree"] is False and info["differences"][0]["module"] == "b"
        gauge = {s.labels["stage"]: s.value for f in check.collect() for s in f.samples}
        assert gauge == {"a": 1.0, "b": 0.0, "c": 0.0}
        want["a"] = "b"  # the stages file fixed (a reload)
        check.update(fams)
        assert len(_events(caplog, "module_stages_agree")) == 1 and check.info()["agree"] is True
        check.update(fams)
        assert len(_events(caplog, "module_stages_agree")) == 1
        assert len(_events(caplog, "module_stage_mismatch")) == 1


def test_an_old_module_is_said_once_and_left_unknown(caplog: pytest.LogCaptureFixture) -> None:
    check = ModuleStageCheck(lambda: {"a": None})
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        check.update(list(text_string_to_metric_families(OLD_PAGE)))
        check.update(list(text_string_to_metric_families(OLD_PAGE)))
    assert len(_events(caplog, "module_stages_unknown")) == 1
    assert check.info()["agree"] is None and list(check.collect()) == []


def test_a_changed_module_config_is_checked_again(caplog: pytest.LogCaptureFixture) -> None:
    check = ModuleStageCheck(lambda: {"a": "b", "b": None, "c": None})
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        check.update(list(text_string_to_metric_families(PAGE)))
        assert check.info()["agree"] is True
        # Apache reloaded with OvertakeStageNext a c
        check.update(list(text_string_to_metric_families(PAGE.replace('stage="a",next="b"', 'stage="a",next="c"'))))
    (rec,) = _events(caplog, "module_stage_mismatch")
    assert rec.__dict__["detail"]["module"] == "c" and rec.__dict__["detail"]["stages_file"] == "b"
    assert check.info()["agree"] is False
