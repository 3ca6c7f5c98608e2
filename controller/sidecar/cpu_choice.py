"""``--cpu-priority auto``: the CPU priority the sidecar asks of Apache, chosen from the stages file.

Two ways to let short requests overtake long ones on the CPU reach mod_overtake_prio (or the
PHP extension behind PHP-FPM): *age* demotes a request once its thread has used a threshold of
CPU, *class* starts a request at the low level when its size, predicted from its route's
learned ``key``, is among its stage's largest (:mod:`~overtake.controller.sidecar.size_class`).
Where a stage can predict sizes, the class is the better choice: it demotes a large request
from its first instruction instead of after the threshold, and never the small ones that happen
to run past the threshold. Age needs nothing but the module, so it is the choice elsewhere,
provided the sidecar can give the module the policy's thresholds (``--control-file``);
otherwise the sidecar cannot know what Apache runs and counts on no CPU priority.

The rules, in order:

1. ``enforce: module`` forwards no request, so no class header: age with a control file, else off.
2. A stage eligible for the size class (a learned ``key``, no ``lock``, not ``cpu_exempt``
   for GET): class.
3. A control file: age.
4. Otherwise off.
"""

from __future__ import annotations

from dataclasses import dataclass

from overtake.controller.sidecar.stages import StageTable

__all__ = ["CpuChoice", "choose_cpu_priority", "class_stages"]


@dataclass(frozen=True)
class CpuChoice:
    """What was asked (``auto`` or a fixed value), what runs, and why."""

    requested: str
    chosen: str
    reason: str

    def info(self) -> dict[str, str]:
        return {"requested": self.requested, "chosen": self.chosen, "reason": self.reason}


def class_stages(table: StageTable) -> tuple[str, ...]:
    """The stages whose requests the size class may start low: a learned key to predict from,
    no lock (a demoted holder would make every waiter wait at its priority), GET not exempt."""
    return tuple(name for i, name in enumerate(table.names)
                 if table.keyed(i) and table.lock(i) is None and not table.lock_auto(i)
                 and not table.cpu_exempt(i, "GET"))


def choose_cpu_priority(requested: str, table: StageTable, *, module_mode: bool,
                        control_file: bool) -> CpuChoice:
    """The CPU priority to run (module docstring); ``requested`` other than ``auto`` is kept.

    >>> from overtake.controller.sidecar.stages import StagesConfig, StageTable
    >>> t = StageTable(StagesConfig.model_validate({"stages": [
    ...     {"name": "edit", "routes": [{"path": "^/edit$", "key": ["body_size"]}], "lock": 1, "next": "view"},
    ...     {"name": "view", "routes": [{"path": "^/view$", "key": ["link"]}]}]}))
    >>> choose_cpu_priority("auto", t, module_mode=False, control_file=False).chosen
    'class'
    >>> choose_cpu_priority("auto", t, module_mode=True, control_file=True).chosen
    'age'
    """
    if requested != "auto":
        return CpuChoice(requested, requested, "set by --cpu-priority")
    age_or_off = ("age", "the sidecar gives mod_overtake_prio the policy's age thresholds through the "
                         "control file") if control_file else (
        "off", "no stage predicts its requests' sizes (a route key) and there is no --control-file to give "
               "mod_overtake_prio the policy's age thresholds")
    if module_mode:
        chosen, why = age_or_off
        return CpuChoice("auto", chosen, "enforce: module forwards no request to carry a class header; " + why)
    sized = class_stages(table)
    if sized:
        return CpuChoice("auto", "class", f"stage{'s' if len(sized) > 1 else ''} {', '.join(sized)} predict"
                         f"{'' if len(sized) > 1 else 's'} each request's size from its route key: the largest "
                         "start at the low level")
    return CpuChoice("auto", *age_or_off)
