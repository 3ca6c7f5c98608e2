"""Errors raised by the uplink room (:mod:`overtake.controller.uplink`).

::

    ControllerError (controller.errors)
    └── UplinkError
        ├── UplinkInputError(ValueError)   a bad argument: cutoffs, bands, rate, dev, mode, ...
        ├── QdiscPermissionError           no CAP_NET_ADMIN: the qdisc cannot be installed
        └── QdiscError                     tc/ethtool failed, or the kernel lacks the qdisc

The uplink room's own tree under the controller's root
:class:`overtake.controller.errors.ControllerError`. Messages name the field, the value and the fix.
"""

from __future__ import annotations

from overtake.controller.errors import ControllerError

__all__ = ["QdiscError", "QdiscPermissionError", "UplinkError", "UplinkInputError"]


class UplinkError(ControllerError):
    """Root of the uplink scheduler's errors."""


class UplinkInputError(UplinkError, ValueError):
    """An argument of the uplink modules is invalid."""


class QdiscPermissionError(UplinkError):
    """The caller lacks CAP_NET_ADMIN, so no qdisc can be installed (fall back to app-level)."""


class QdiscError(UplinkError):
    """A tc/ethtool command failed or the kernel lacks the needed qdisc."""
