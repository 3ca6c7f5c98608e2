"""Phase names: which phase of its stage's phase-type service time a request is in, by mean.

A phase-type representation numbers its phases as the fit happened to build them: a CF1 chain
(Bobbio and Cumani, *ML estimation of the parameters of a PH distribution in triangular
canonical form*) runs from its slowest phase to its fastest, so phase 1 of a CF1 fit is the
*longest* kind. Users, phase headers and the solver need one meaning instead. A phase's mean is
the expected remaining service from it, ((−T)⁻¹1)_j, and phases are ranked by it: ``overtake fit``
writes its phases in that order (phase 1 the shortest, :meth:`overtake.fitting.PhaseType.by_mean`),
and with two phases they are also named ``short`` and ``long``. Names always follow the means;
a number is the phase's position in the representation (the same thing for every fit).

The header ``X-Overtake-Phase`` takes a number ``1..M`` (ASCII digits) or a name, case-insensitive.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_PHASES", "TWO_PHASE_NAMES", "accepted_values", "mean_order", "parse_phase", "phase_means", "phase_names"]

#: the names of a two-phase stage's phases, shortest first
TWO_PHASE_NAMES = ("short", "long")
#: the most phases a stage's service time can have (a scenario's PH order): what a phase header
#: may name when no model says how many a stage has
MAX_PHASES = 64

_MAX_DIGITS = 6  # a phase number has at most this many digits (int() of a long string is refused)


def phase_means(T: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Expected remaining service from each phase, (−T)⁻¹1, in the unit of ``T``'s rates."""
    t = np.asarray(T, dtype=np.float64)
    return np.asarray(np.linalg.solve(-t, np.ones(t.shape[0])), dtype=np.float64)


def mean_order(T: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Phase indices from the shortest mean to the longest (ties keep their order)."""
    return np.asarray(np.argsort(phase_means(T), kind="stable"), dtype=np.int64)


def phase_names(T: npt.ArrayLike) -> tuple[str, ...]:
    """Each phase's name, by index: ``short``/``long`` for two phases, else its rank by mean
    (``"1"`` the shortest)."""
    order = mean_order(T)
    words: Sequence[str] = TWO_PHASE_NAMES if order.size == 2 else [str(r + 1) for r in range(order.size)]
    out = [""] * order.size
    for rank, j in enumerate(order):
        out[int(j)] = words[rank]
    return tuple(out)


def accepted_values(m: int, names: Sequence[str] | None) -> str:
    """What a phase header may say for a stage of ``m`` phases, for error messages."""
    nums = "1" if m == 1 else f"1..{m}"
    words = [n for n in (names or ()) if not n.isdigit()]
    return nums + (f" or {', '.join(words)}" if words else "")


def parse_phase(value: bytes | str, m: int, names: Sequence[str] | None) -> int | None:
    """The 0-based phase a header value names, or None when it names none of the ``m`` phases.

    A number is the phase's position (ASCII digits only: ``٣`` or ``²`` are not numbers here);
    a name (case-insensitive) is looked up in ``names`` (by index, from :func:`phase_names`).
    """
    text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
    if text.isascii() and text.isdigit():
        if len(text) > _MAX_DIGITS:
            return None
        j = int(text)
        return j - 1 if 1 <= j <= m else None
    if names:
        low = text.lower()
        for j, name in enumerate(names[:m]):
            if name == low:
                return j
    return None
