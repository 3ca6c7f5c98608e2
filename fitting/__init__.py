"""Phase-type distributions fitted by EM from measured service times.

Data flow: durations (array, CSV, Apache log via :mod:`overtake.fitting.io`) → :func:`fit` /
:func:`fit_binned` → :class:`FitResult` whose ``ph`` (:class:`PhaseType`) is written as
``{"alpha": [...], "T": [[...]], ...}`` for the solver (mdp/). This package is pure: no
environment reads, no asyncio; file reading lives only in :mod:`overtake.fitting.io`.

The names below are imported from their modules on first use (PEP 562), so ``import
overtake.fitting.errors`` (the command line's start) does not pay for numpy, numba and the EM.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .data import Observations, binned, samples
    from .diagnostics import Diagnostics, diagnose
    from .em import STRUCTURES, fit, fit_binned, fit_observations
    from .errors import (
        DataError,
        FittingError,
        FittingInputError,
        InvalidParameterError,
        LogFormatError,
        MissingDependencyError,
        MomentError,
    )
    from .families import cf1, coxian, erlang, exponential, hyper_erlang, hyperexponential, to_cf1
    from .moments import match_three_moments, match_two_moments
    from .phase_type import PhaseType, check_random_state
    from .result import FitResult, OrderScore

__all__ = [
    "DataError",
    "Diagnostics",
    "FitResult",
    "FittingError",
    "FittingInputError",
    "InvalidParameterError",
    "LogFormatError",
    "MissingDependencyError",
    "MomentError",
    "Observations",
    "OrderScore",
    "PhaseType",
    "STRUCTURES",
    "binned",
    "cf1",
    "check_random_state",
    "coxian",
    "diagnose",
    "erlang",
    "exponential",
    "fit",
    "fit_binned",
    "fit_observations",
    "hyper_erlang",
    "hyperexponential",
    "match_three_moments",
    "match_two_moments",
    "samples",
    "to_cf1",
]

#: the module of each name in ``__all__``
_HOME: dict[str, str] = {
    "DataError": "errors",
    "Diagnostics": "diagnostics",
    "FitResult": "result",
    "FittingError": "errors",
    "FittingInputError": "errors",
    "InvalidParameterError": "errors",
    "LogFormatError": "errors",
    "MissingDependencyError": "errors",
    "MomentError": "errors",
    "Observations": "data",
    "OrderScore": "result",
    "PhaseType": "phase_type",
    "STRUCTURES": "em",
    "binned": "data",
    "cf1": "families",
    "check_random_state": "phase_type",
    "coxian": "families",
    "diagnose": "diagnostics",
    "erlang": "families",
    "exponential": "families",
    "fit": "em",
    "fit_binned": "em",
    "fit_observations": "em",
    "hyper_erlang": "families",
    "hyperexponential": "families",
    "match_three_moments": "moments",
    "match_two_moments": "moments",
    "samples": "data",
    "to_cf1": "families",
}


def __getattr__(name: str) -> _typing.Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
