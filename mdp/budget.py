"""A state budget: refuse a solve whose state space will not fit, before anything is allocated.

A tandem of N stages with D phases in all has a state space that grows like C^(2D) in the caps
(:func:`overtake.mdp.statespace.count_states`): two stages of order 12 need ~10^12 states where
two of order 3 need ~2·10^6. The solve must be refused while that is only a number, with one line
naming the estimate, the budget and the fix.
"""

from __future__ import annotations

from math import comb

from .caps import next_solve_cap
from .errors import TruncationError
from .model import TandemModel
from .optimum import estimate_states
from .statespace import PhaseInfo, Truncation

__all__ = ["BYTES_PER_STATE", "DEFAULT_MAX_STATES", "StateBudgetError", "check_budget", "max_uniform_order",
           "shape_states"]

#: The default budget. CPU time and memory grow with the states (BENCHMARKS.md, mdp-scale), and
#: auto-truncation solves several times near its largest space: 4 M states keeps the whole
#: compare within minutes and a few GB on a small machine.
DEFAULT_MAX_STATES = 4_000_000

#: Resident memory per state of a solve, a bound on plain RVI's and Anderson's (BENCHMARKS.md
#: ``mdp-scale``), for the estimate printed with a refusal.
BYTES_PER_STATE = 1000


class StateBudgetError(TruncationError):
    """The state space a solve would build exceeds the budget (``--max-states``)."""


def shape_states(n_stages: int, phases: int, cores: int, phase_info: PhaseInfo = "full") -> int:
    """:func:`estimate_states` of an auto-truncated solve of ``n_stages`` stages of ``phases``
    phases each on ``cores`` cores, from the shape alone (the state space depends on nothing else)."""
    D = n_stages * phases
    Q = D if phase_info == "full" else n_stages
    start = Truncation(10, min(cores + 2, 10))
    C = next_solve_cap(start.max_requests)
    km = min(start.k_max + 1, C)
    return int(sum(comb(s + D - 1, D - 1) * comb(C - s + Q, Q) for s in range(km + 1)))


def max_uniform_order(n_stages: int, cores: int, max_states: int, phase_info: PhaseInfo = "full") -> int:
    """The largest order p such that ``n_stages`` stages of order p fit ``max_states`` (0: none)."""
    p = 0
    while p < 64 and shape_states(n_stages, p + 1, cores, phase_info) <= max_states:
        p += 1
    return p


def _counted(phase_info: PhaseInfo) -> PhaseInfo:
    # the observed layouts queue by stage (route: by route, of the same order): counted as "start"
    return "start" if phase_info in ("none", "route") else phase_info


def check_budget(model: TandemModel, *, max_states: int, truncation: Truncation | None = None,
                 phase_info: PhaseInfo = "full") -> int:
    """The estimated states of π*'s largest solve; :class:`StateBudgetError` above ``max_states``."""
    if not isinstance(max_states, int) or max_states < 1:
        raise StateBudgetError(f"--max-states must be an integer >= 1, got {max_states!r}")
    est = estimate_states(model, truncation, _counted(phase_info))
    if est <= max_states:
        return est
    gb = est * BYTES_PER_STATE / 1e9
    orders = [st.phases for st in model.stages]
    p = max_uniform_order(model.n_stages, model.cores, max_states, _counted(phase_info))
    fix = (f"fit with --order {p} or fewer" if p >= 1 else "use fewer stages") + ", or raise --max-states"
    if truncation is not None:
        fix = f"give a smaller truncation (max_requests, max_threads), {fix}"
    raise StateBudgetError(
        f"state space: an estimated {est:,} states (~{gb:,.1f} GB) for stages of order "
        f"{'+'.join(map(str, orders))} exceeds --max-states {max_states:,}; {fix}")

