"""Errors raised by :mod:`overtake.fitting`.

Hierarchy (catch at the level you need)::

    OvertakeError (overtake.errors)
    └── FittingError                      root of every error raised by fitting/
        ├── FittingInputError(ValueError) bad input; the message names field, value and rule
        │   ├── InvalidParameterError     (alpha, T) is not a phase-type representation
        │   ├── DataError                 samples, weights, censoring flags or bins are unusable
        │   ├── MomentError               moments no distribution of the requested family can match
        │   └── LogFormatError            an Apache ``LogFormat`` / stage regex / input file is unusable
        └── MissingDependencyError(ImportError)
                                          an optional dependency (cvxpy, apachelogs) is not installed

Non-convergence is *not* an error: :class:`overtake.fitting.FitResult` reports ``converged`` and
``n_iter`` honestly and the caller decides.
"""

from __future__ import annotations

from overtake.errors import OvertakeError

__all__ = [
    "DataError",
    "FittingError",
    "FittingInputError",
    "InvalidParameterError",
    "LogFormatError",
    "MissingDependencyError",
    "MomentError",
]


class FittingError(OvertakeError):
    """Root of every error raised by :mod:`overtake.fitting`."""


class FittingInputError(FittingError, ValueError):
    """Input rejected; the message names the field, the value and the rule."""


class InvalidParameterError(FittingInputError):
    """``(alpha, T)`` is not a valid phase-type representation."""


class DataError(FittingInputError):
    """Samples, weights, censoring flags or histogram bins are unusable for fitting."""


class MomentError(FittingInputError):
    """The requested moments cannot be matched by the requested family."""


class LogFormatError(FittingInputError):
    """An Apache ``LogFormat``, a stage regex or an input file cannot be used."""


class MissingDependencyError(FittingError, ImportError):
    """An optional dependency needed by the requested feature is not installed."""
