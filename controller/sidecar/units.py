"""The sidecar's time unit: how many seconds one model time unit is, taken from the policy.

A solved policy's model — its service times, its predicted E[W], the age threshold it recommends
for ``OvertakePrioLevels`` — is in the unit of the scenario it was solved from, while the sidecar
measures seconds. ``overtake solve`` stores that unit in the policy file (``meta["time_unit"]``: a
number of seconds, 1 for every scenario built on ``overtake fit`` output, or ``"model"`` for a
scenario in an abstract unit such as van der Weij et al.'s Table 1). The unit in force is decided here,
one rule for the start, every swap and every reload:

=====================================  ==============================================================
the policy says                        the sidecar uses
=====================================  ==============================================================
a number *u*                           *u*; a stages file ``classifier.time_unit`` ≠ *u* is refused
``model``                              the stages file's ``classifier.time_unit``; none is refused
nothing (a file from before units      the stages file's value, else 0.01 (its default then), with
were recorded)                         a warning once per policy
nothing to convert (``pi(k)``,         the stages file's value, else the unit in force (seconds at
``passthrough``)                       start): a baseline has no model times
=====================================  ==============================================================

A directory of policies (``classifier.mode: auto``) is resolved over its members: their numbers
must agree. Every refusal is one :class:`~overtake.controller.errors.PolicyLoadError` line naming
both values and the fix; a swap so refused keeps the running policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overtake.controller.errors import PolicyLoadError

__all__ = ["FORMER_DEFAULT", "MODEL", "UNITLESS", "UNRECORDED", "Resolution", "policy_unit", "resolve", "units_of"]

#: a scenario in an abstract unit (``time_unit: model``)
MODEL = "model"
#: a policy file written before policies carried their unit
UNRECORDED = "unrecorded"
#: a baseline: no model, no times to convert
UNITLESS = "unitless"
#: ``classifier.time_unit``'s default before policies carried their unit (van der Weij et al.'s unit as
#: 10 ms of CPU on the private Apache); used only for unrecorded policies without a stages value
FORMER_DEFAULT = 0.01

Unit = float | str


def policy_unit(meta: dict[str, Any], name: str) -> Unit:
    """A policy file's unit from its metadata: seconds, :data:`MODEL` or :data:`UNRECORDED`.

    Raises
    ------
    PolicyLoadError
        The metadata holds something else (a hand-edited or corrupt file).
    """
    if "time_unit" not in meta or meta["time_unit"] is None:
        return UNRECORDED
    u = meta["time_unit"]
    if u == MODEL:
        return MODEL
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < math.inf:
        raise PolicyLoadError(f"policy: {name}: metadata time_unit must be seconds per model unit (a number > 0) "
                              f"or 'model', got {u!r}; re-solve it with `overtake solve`")
    return float(u)


def units_of(policy: Any) -> list[tuple[str, Unit]]:
    """(name, unit) of a policy, or of each member of a directory of policies."""
    members = getattr(policy, "members", None)
    if members is not None:
        return [(m.name, getattr(m, "time_unit", UNITLESS)) for m in members]
    return [(policy.name, getattr(policy, "time_unit", UNITLESS))]


@dataclass(frozen=True)
class Resolution:
    """The unit a policy runs at: ``seconds`` (None: the policy has no times, keep the unit in
    force), where it came from (for logs), and the policies that recorded none (to warn about)."""

    seconds: float | None
    source: str
    unrecorded: tuple[str, ...] = ()


def resolve(members: Sequence[tuple[str, Unit]], stages_unit: float | None) -> Resolution:
    """The unit for a policy whose members have ``members``' units, under a stages file whose
    ``classifier.time_unit`` is ``stages_unit`` (None: not given). See the module's table."""
    numbers = [(n, u) for n, u in members if isinstance(u, float)]
    unrecorded = tuple(n for n, u in members if u == UNRECORDED)
    abstract = [n for n, u in members if u == MODEL]
    for n, u in numbers:
        if stages_unit is not None and not math.isclose(u, stages_unit, rel_tol=1e-9):
            raise PolicyLoadError(
                f"classifier.time_unit: the stages file says {stages_unit:g} s per model unit but policy {n} was "
                f"solved in units of {u:g} s (its scenario's time_unit); remove classifier.time_unit from the stages "
                f"file (the policy carries its unit) or re-solve with time_unit: {stages_unit:g} in the scenario")
        first, fu = numbers[0]
        if not math.isclose(u, fu, rel_tol=1e-9):
            raise PolicyLoadError(f"policy: {first} is in units of {fu:g} s but {n} in units of {u:g} s; "
                                  "solve the policies from scenarios in one unit")
    if stages_unit is not None:
        return Resolution(stages_unit, "the stages file's classifier.time_unit", unrecorded)
    if abstract:
        raise PolicyLoadError(
            f"classifier.time_unit: policy {abstract[0]} is in its scenario's abstract unit (time_unit: model); set "
            "classifier.time_unit in the stages file to the seconds one unit stands for (e.g. 0.01), or give the "
            "scenario a time_unit in seconds and re-solve")
    if numbers:
        return Resolution(numbers[0][1], f"policy {numbers[0][0]}", unrecorded)
    if unrecorded:
        return Resolution(FORMER_DEFAULT, "classifier.time_unit's former default", unrecorded)
    return Resolution(None, "no model times (a baseline)")
