"""Module mode (``enforce: module``): the policy inside Apache, the sidecar beside it.

mod_overtake_prio holds the requests of its ``OvertakeStage`` sections by the count table of a
blind policy (:mod:`overtake.controller.sidecar.count_table`), which the sidecar writes to the
control file at start and after every refit or swap; no request passes through the sidecar, which
refits from Apache's access log, exports the module's counters and serves its admin endpoints.
What needs each request in the proxy stays with ``enforce: sidecar``: phase headers, route
classes, uplink SRPT, the admission gate. :func:`enforce_for` says which mode an information
level needs (``classifier.mode: auto`` reports it with its choice).
"""

from __future__ import annotations

from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.count_table import module_blocker
from overtake.controller.sidecar.options import SidecarOptions

__all__ = ["ENFORCE_FOR", "check_module_options", "check_module_policy", "enforce_for"]

#: the enforcement each information level needs: only counts per stage reach the module
ENFORCE_FOR = {"full": "sidecar", "start": "sidecar", "route": "sidecar", "none": "module"}


def enforce_for(info: str, uplink: str = "fair") -> str:
    """``module`` when the module can enforce a policy of information ``info`` with uplink ``uplink``,
    else ``sidecar`` (phase headers and route classes are read from each request, uplink SRPT orders
    each response's bytes: both need the proxy in the path)."""
    if uplink != "fair":
        return "sidecar"
    return ENFORCE_FOR.get(info, "sidecar")


def check_module_options(o: SidecarOptions) -> None:
    """The options module mode needs and those it cannot serve, each error naming the key.

    Raises
    ------
    SidecarInputError
        No ``control_file``, or an option that needs requests to pass through the sidecar.
    """
    if o.enforce not in ("sidecar", "module"):
        raise SidecarInputError(f"enforce: must be sidecar or module, got {o.enforce!r}")
    if o.enforce != "module":
        return
    if not o.apache_side.control_file:
        raise SidecarInputError("control_file: enforce: module writes the count table there; give the path of "
                                "Apache's OvertakeControlFile (e.g. /dev/shm/overtake-control)")
    if o.uplink.name != "fair":
        raise SidecarInputError(f"uplink: {o.uplink.name} orders responses in the proxy; enforce: module passes no "
                                "response through the sidecar (use uplink: fair, or enforce: sidecar)")
    if o.phase_header:
        raise SidecarInputError("phase_header: the module sees no phase header (counts per stage only); drop it "
                                "or use enforce: sidecar")
    if o.apache_side.gate:
        raise SidecarInputError("gate: the admission gate holds requests the sidecar forwards; enforce: module "
                                "holds them in Apache by the count table itself: drop gate")
    if o.online is not None and not o.online.access_log:
        raise SidecarInputError("online.access_log: enforce: module passes no request through the sidecar; the "
                                "refit reads demands and arrivals from Apache's access log (--access-log "
                                "WORKDIR/logs/access.log)")
    if o.apache_side.cpu_priority == "class":
        raise SidecarInputError("cpu_priority: class sets a header on each forwarded request; enforce: module "
                                "forwards none: use age or off")


def check_module_policy(policy: Any, field: str = "policy") -> None:
    """Refuse a policy the module cannot enforce (it sees phases or route classes).

    Raises
    ------
    SidecarInputError
        Naming ``field``.
    """
    why = module_blocker(policy)
    if why is not None:
        raise SidecarInputError(f"{field}: {why}")
