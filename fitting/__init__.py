"""Phase-type distributions fitted by EM from measured service times.

Data flow: durations (array, CSV, Apache log via :mod:`overtake.fitting.io`) → :func:`fit` /
:func:`fit_binned` → :class:`FitResult` whose ``ph`` (:class:`PhaseType`) is written as
``{"alpha": [...], "T": [[...]], ...}`` for the solver (mdp/). This package is pure: no
environment reads, no asyncio; file reading lives only in :mod:`overtake.fitting.io`.
"""

from __future__ import annotations

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
