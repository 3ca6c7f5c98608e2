"""``enforce: module``: the options it needs and refuses, each error naming its field; which
enforcement each information level needs (what ``auto`` reports); the policies it takes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from overtake.controller.errors import SidecarInputError
from overtake.controller.online import OnlineSettings
from overtake.controller.online.estimators import DemandRecorder
from overtake.controller.sidecar.config import load_config, to_options
from overtake.controller.sidecar.count_table import from_policy
from overtake.controller.sidecar.module_mode import check_module_options, check_module_policy, enforce_for
from overtake.controller.sidecar.policies import BaselinePolicy
from overtake.controller.sidecar.stages import StagesConfig, StageTable

BASE = {"apache": "http://127.0.0.1:8080", "listen": "127.0.0.1:8081", "stages": "stages.yaml",
        "policy": "pi(2)", "enforce": "module", "control_file": "/dev/shm/c"}


def _check(tmp_path: Path, **over: object) -> None:
    check_module_options(to_options(load_config(None, {**BASE, **over})))


@pytest.mark.parametrize(("over", "field"), [
    ({"control_file": None}, "control_file:"),
    ({"uplink": "srpt"}, "uplink:"),
    ({"phase_header": "X-Phase"}, "phase_header:"),
    ({"gate": "/dev/shm/g"}, "gate:"),
    ({"cpu_priority": "class"}, "cpu_priority:"),
])
def test_module_mode_refuses_what_needs_the_proxy(tmp_path: Path, over: dict[str, object], field: str) -> None:
    data = dict(BASE)
    data.update(over)
    if over.get("control_file", "") is None:
        del data["control_file"]
    with pytest.raises(SidecarInputError, match=f"^{field}"):
        check_module_options(to_options(load_config(None, data)))


def test_module_mode_accepts_age_priority_and_the_sidecar_mode_is_unchanged(tmp_path: Path) -> None:
    _check(tmp_path, cpu_priority="age")
    check_module_options(to_options(load_config(None, {**BASE, "enforce": "sidecar", "uplink": "srpt",
                                                       "control_file": None})))


def test_module_mode_needs_no_listen_and_the_proxy_does() -> None:
    data = {k: v for k, v in BASE.items() if k != "listen"}
    opts = to_options(load_config(None, data))
    check_module_options(opts)
    assert opts.endpoints.listen is None
    with pytest.raises(SidecarInputError, match=r"^command line: listen: required: .*--listen"):
        load_config(None, {**data, "enforce": "sidecar", "control_file": None})


def test_an_unknown_enforce_value_names_the_field() -> None:
    with pytest.raises(SidecarInputError, match="enforce"):
        load_config(None, {**BASE, "enforce": "proxy"})


def test_enforce_for_each_information_level() -> None:
    assert enforce_for("none") == "module"
    assert [enforce_for(i) for i in ("full", "start", "route")] == ["sidecar"] * 3
    assert enforce_for("none", "srpt") == "sidecar"  # uplink SRPT orders bytes in the proxy


def test_policies_the_module_takes() -> None:
    check_module_policy(BaselinePolicy("pi(1,3)", 2))
    seeing = SimpleNamespace(name="case.npz", phase_info="full", per_phase_queues=True)
    with pytest.raises(SidecarInputError, match=r"^policy: policy case.npz sees phase_info 'full'"):
        check_module_policy(seeing)
    with pytest.raises(ValueError, match="phase_info 'full'"):
        from_policy(seeing, ["a", "b"])


def test_stage_names_the_module_does_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="OvertakeStage"):
        from_policy(BaselinePolicy("pi(1)", 1), ["a stage"])


def test_module_mode_refits_need_the_access_log_and_count_its_records_as_arrivals(tmp_path: Path) -> None:
    with pytest.raises(SidecarInputError, match="^online.access_log"):
        check_module_options(to_options(load_config(None, {**BASE, "online": {"enabled": True}})))
    table = StageTable(StagesConfig.model_validate({"stages": [{"name": "stage1", "path": "^/a"},
                                                               {"name": "stage2", "path": "^/b"}]}))
    now = [100.0]
    for from_log, arrivals in ((False, 0), (True, 3)):
        rec = DemandRecorder(OnlineSettings(access_log=str(tmp_path / "access.log"), arrivals_from_log=from_log),
                             table, time_unit=0.01, cores=1, overhead=0.0, clock=lambda: now[0])
        assert rec.poll_log([(0, 0.01), (0, 0.02), (1, 0.01), (0, 0.03)]) == 4
        assert len(rec.stages[0].reservoirs["access_log"]) == 3  # the demands either way
        assert rec.arrivals[0].total == arrivals  # arrivals only in module mode (stage 1: transactions)


def test_the_refit_takes_the_modules_cpu_note_only_where_the_module_saw_the_work_in_apache(tmp_path: Path) -> None:
    """The sidecar tells its log reader where each stage's work runs from the module's counts of
    where requests were served (``overtake_stage_served_total{by}``): unknown before any, then the
    most served place; the reader uses the module's thread-CPU note as a demand only for ``apache``."""
    from prometheus_client.parser import text_string_to_metric_families

    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar

    table = StageTable(StagesConfig.model_validate({"stages": [{"name": "stage1", "path": "^/a"},
                                                               {"name": "stage2", "path": "^/b"}]}))
    side = Sidecar(table, SidecarOptions.from_flat(policy="pi(2)", apache="http://127.0.0.1:9", listen="127.0.0.1:9",
                                                   online=OnlineSettings(access_log=str(tmp_path / "access.log"))))
    assert side.online is not None and side.online.recorder.tail is not None
    where = side.online.recorder.tail.runs_in
    assert where is not None and where("stage1") is None
    side.stacks.update(text_string_to_metric_families(
        "# TYPE overtake_stage_served_total counter\n"
        'overtake_stage_served_total{stage="stage1",by="apache"} 5\n'
        'overtake_stage_served_total{stage="stage1",by="fcgi"} 1\n'
        'overtake_stage_served_total{stage="stage2",by="fcgi"} 7\n'))
    assert (where("stage1"), where("stage2")) == ("apache", "fcgi")
