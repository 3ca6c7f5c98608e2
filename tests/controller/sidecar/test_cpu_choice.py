"""``--cpu-priority auto``: which CPU priority a stages file leads to, and why (known answers per rule)."""

from __future__ import annotations

import pytest
import yaml

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.cpu_choice import choose_cpu_priority, class_stages
from overtake.controller.sidecar.options import SidecarOptions, check_numbers, with_cpu_priority
from overtake.controller.sidecar.stages import StagesConfig, StageTable


def _table(view: str) -> StageTable:
    doc = yaml.safe_load(f"""stages:
  - {{name: preview, routes: [{{path: "^/p$", key: [body_size]}}], next: view, lock: 1}}
  - {{name: view, routes: [{{path: "^/v$"{view}}}]}}
""")
    return StageTable(StagesConfig.model_validate(doc))


LINKED = ', key: [link]'


@pytest.mark.parametrize(("view", "module", "control", "chosen"), [
    (LINKED, False, False, "class"),  # a view predicted from its preview
    (LINKED, False, True, "class"),  # the class wins over age even with a control file
    (LINKED, True, True, "age"),  # module mode forwards nothing to carry the header
    (LINKED, True, False, "off"),
    ("", False, True, "age"),  # only the locked preview is keyed: never demoted by class
    ("", False, False, "off"),
])
def test_the_rules_in_order(view: str, module: bool, control: bool, chosen: str) -> None:
    c = choose_cpu_priority("auto", _table(view), module_mode=module, control_file=control)
    assert (c.requested, c.chosen) == ("auto", chosen)
    assert ("view" in c.reason) == (chosen == "class")
    assert ("control file" in c.reason) == (chosen == "age")


def _view(extra: str) -> StageTable:
    doc = yaml.safe_load(f"""stages:
  - {{name: preview, routes: [{{path: "^/p$", key: [body_size]}}], next: view, lock: 1}}
  - {{name: view, routes: [{{path: "^/v$", key: [link]}}]{extra}}}
""")
    return StageTable(StagesConfig.model_validate(doc))


@pytest.mark.parametrize(("extra", "stages"), [
    ("", ("view",)), (", cpu_exempt: unsafe", ("view",)),  # GETs may still start low
    (", cpu_exempt: all", ()), (", lock: 1", ()), (", lock: auto", ())])
def test_stages_the_class_cannot_demote_do_not_count(extra: str, stages: tuple[str, ...]) -> None:
    t = _view(extra)
    assert class_stages(t) == stages
    assert choose_cpu_priority("auto", t, module_mode=False, control_file=False).chosen == (
        "class" if stages else "off")


@pytest.mark.parametrize("asked", ["off", "age", "class"])
def test_a_fixed_value_is_kept(asked: str) -> None:
    c = choose_cpu_priority(asked, _table(LINKED), module_mode=False, control_file=True)
    assert c.chosen == asked and c.reason == "set by --cpu-priority"


def test_the_option_names_auto_among_its_values() -> None:
    o = with_cpu_priority(SidecarOptions.from_flat(policy="pi(1)", apache="http://127.0.0.1:1", listen="127.0.0.1:2"), "fast")
    with pytest.raises(SidecarInputError, match=r"cpu_priority: expected off, auto, age or class, got 'fast'"):
        check_numbers(o)
