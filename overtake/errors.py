"""The root of every error Overtake raises on purpose.

Each package keeps its own ``errors.py`` with its tree drawn in the docstring; all of them hang
from this one class, so a caller can catch everything the project raises with one clause::

    OvertakeError
    ├── FittingError      overtake.fitting.errors
    ├── MDPError          overtake.mdp.errors
    ├── ControllerError   overtake.controller.errors
    └── ApiError          overtake.api.errors

Input errors also subclass :class:`ValueError` (the CLI reports them as usage errors, exit 2)
and their messages name the field, the value and the fix.
"""

from __future__ import annotations

__all__ = ["OvertakeError"]


class OvertakeError(Exception):
    """Root of every error Overtake raises on purpose."""
