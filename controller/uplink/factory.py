"""``make_uplink(name)``: the scheduler named on the command line, and the bands it can use.

SRPT and SRRT need a priority qdisc (:mod:`overtake.controller.uplink.qdisc`) and the right to
set its priorities; without either they fall back to the application-level ordering (Crovella et al.,
"Connection scheduling in web servers") and say so in ``describe()``.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess

from overtake.controller.uplink import bands as _bands
from overtake.controller.uplink import qdisc as _qdisc
from overtake.controller.uplink import tcpinfo as _ti
from overtake.controller.uplink.app import AppUplink
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.fair import FairUplink
from overtake.controller.uplink.flow import Uplink
from overtake.controller.uplink.kernel import KernelUplink, check_lowest_writers

__all__ = ["NAMES", "default_cutoffs", "detect_bands", "make_uplink"]

# the package's logger: its name did not change when the scheduler was split into modules
log = logging.getLogger("overtake.controller.uplink")

NAMES = ("app", "fair", "srpt", "srrt")


def _priority_allowed(priority: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        _ti.set_priority(s, priority)
        return True
    except PermissionError:
        return False
    finally:
        s.close()


def detect_bands(dev: str | None = None, *, netns: str | None = None) -> _qdisc.BandMap | None:
    """Band map of the qdisc in use: ``dev``'s, or the first of ours on any interface.

    HTB (ours) wins, then TBF + pfifo_fast or a plain pfifo_fast root; ``None`` when no
    interface has either (e.g. a bare veth with ``noqueue``).
    """
    if dev is not None:
        state = _qdisc.show(dev, netns=netns)
        if state.bands is not None:
            return state.bands
        return _qdisc.PFIFO_FAST_BANDS if state.root_kind == "pfifo_fast" else None
    cmd = (["tc", "-n", netns] if netns else ["tc"]) + ["-j", "qdisc", "show"]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        qdiscs = json.loads(cp.stdout or "[]")
    except ValueError:
        return None
    devs = sorted({q.get("dev") for q in qdiscs if q.get("root") and q.get("dev")})
    found: _qdisc.BandMap | None = None
    for d in devs:
        try:
            st = _qdisc.show(d, netns=netns)
        except Exception:  # noqa: BLE001 - a vanished interface must not stop detection
            continue
        if st.bands is _qdisc.HTB_BANDS:
            return st.bands
        if st.bands is not None or st.root_kind == "pfifo_fast":
            found = _qdisc.PFIFO_FAST_BANDS
    return found


def make_uplink(
    name: str,
    *,
    bands: str = "auto",
    dev: str | None = None,
    netns: str | None = None,
    cutoffs: _bands.Cutoffs | str | None = None,
    adapt: bool | None = None,
    interval: float = 0.01,
    notsent_lowat: int = 32768,
    concurrency: int = 4,
    quantum: int = 16384,
    max_pacing_rate: int | None = None,
    top_fraction: float = _bands.TOP_FRACTION,
    lowest_writers: int = 0,
    ordered_bands: int = 1,
) -> Uplink:
    """Build the uplink named on the command line (``--uplink fair|srpt|srrt|app``).

    ``bands``: ``auto`` (inspect ``dev`` or every interface, see :func:`detect_bands`),
    ``htb`` or ``pfifo_fast``. SRPT/SRRT fall back to ``app`` when no band arrangement is
    found or HTB priorities are refused (no CAP_NET_ADMIN/CAP_NET_RAW); ``describe()`` says
    which is in use. ``cutoffs``: fixed cutoffs (bytes for SRPT, seconds for SRRT; a string
    like ``"1K,4K,16K"``); by default they start log-spaced (Harchol-Balter et al.'s 1K-50K for SRPT) and
    adapt to the observed distribution (``adapt``; off when cutoffs are given) with
    ``top_fraction`` of the responses above the highest cutoff (Harchol-Balter et al.: 0.005-0.01; the default
    0.005 keeps the largest responses near their FAIR time, where 0.01 slows them; BENCHMARKS.md
    ``uplink-sweep-60s`` has the figures).
    ``concurrency``, ``quantum``, ``max_pacing_rate`` (bytes/s, the link rate) shape ``app``;
    ``lowest_writers`` (srpt, srrt) orders the lowest band's responses, ``ordered_bands`` the
    lowest that many bands' (each its own ``lowest_writers`` turns), see the module docstring.
    """
    check_lowest_writers(lowest_writers, ordered_bands)  # before a fallback could drop it
    _check_name(name, lowest_writers)
    if name == "fair":
        return FairUplink()
    if name == "app":
        return AppUplink(concurrency=concurrency, quantum=quantum, max_pacing_rate=max_pacing_rate)
    bandmap, note = _kernel_bands(name, bands, dev, netns)
    if bandmap is None:
        log.warning("uplink %s: %s; falling back to application-level ordering", name, note)
        return AppUplink(concurrency=concurrency, quantum=quantum, max_pacing_rate=max_pacing_rate,
                         note=f"fallback from {name}: {note}")
    by_time = name == "srrt"
    cuts, adapt = _kernel_cutoffs(cutoffs, adapt, len(bandmap.data), by_time)
    return KernelUplink(bandmap=bandmap, cutoffs=cuts, by_time=by_time, adapt=adapt, interval=interval,
                        lowat=notsent_lowat, note=note, top_fraction=top_fraction, lowest_writers=lowest_writers,
                        ordered_bands=ordered_bands)


def _check_name(name: str, lowest_writers: int) -> None:
    """A scheduler of :data:`NAMES`, and ``lowest_writers`` only where a lowest kernel band exists."""
    if lowest_writers and name not in ("srpt", "srrt"):
        raise UplinkInputError(
            f"lowest_writers: orders the lowest kernel band, only for srpt or srrt, not {name!r}"
        )
    if name not in NAMES:
        raise UplinkInputError(
            f"uplink: unknown scheduler {name!r}; choose one of: {', '.join(NAMES)}"
        )


def _kernel_bands(name: str, bands: str, dev: str | None, netns: str | None) -> tuple[_qdisc.BandMap | None, str]:
    """The band map SRPT/SRRT can use (named, or detected) and a note; None with the reason when
    there is none or its priorities are refused (the caller falls back to ``app``)."""
    if bands not in ("auto", "htb", "pfifo_fast"):
        raise UplinkInputError(f"bands: {bands!r} must be auto, htb or pfifo_fast")
    note = ""
    bandmap: _qdisc.BandMap | None
    if bands == "htb":
        bandmap = _qdisc.HTB_BANDS
    elif bands == "pfifo_fast":
        bandmap = _qdisc.PFIFO_FAST_BANDS
    else:
        bandmap = detect_bands(dev, netns=netns)
        if bandmap is None:
            note = "no HTB or pfifo_fast qdisc found (install with `overtake uplink install`)"
    if bandmap is not None and not _priority_allowed(bandmap.data[0]):
        note = f"SO_PRIORITY {bandmap.data[0]:#x} refused: needs CAP_NET_ADMIN or CAP_NET_RAW"
        bandmap = None
    return bandmap, note


def _kernel_cutoffs(cutoffs: _bands.Cutoffs | str | None, adapt: bool | None, n_bands: int,
                    by_time: bool) -> tuple[_bands.Cutoffs, bool]:
    """The cutoffs (given, parsed from text in the scheduler's unit, or the defaults) and whether
    they adapt (by default only when none were given)."""
    if isinstance(cutoffs, str):
        cutoffs = _bands.parse_cutoffs(cutoffs, unit="seconds" if by_time else "bytes")
    if adapt is None:
        adapt = cutoffs is None
    if cutoffs is None:
        cutoffs = default_cutoffs(n_bands, by_time=by_time)
    return cutoffs, adapt


def default_cutoffs(n_bands: int, *, by_time: bool) -> _bands.Cutoffs:
    """Starting cutoffs: 1K-50K log-spaced (Harchol-Balter et al. §2.2.4); for SRRT the same sizes as
    remaining times of a fresh LAN connection (RTT 1 ms, cwnd 10, MSS 1448; Al Sa'deh and Yahya, "A new
    scheduling policy in web servers", eq. 2)."""
    sizes = _bands.log_spaced(1024.0, 51200.0, n_bands - 1)
    if not by_time:
        return sizes
    fresh = _ti.TcpInfo(1, 1e-3, 10, 1448, 0, 0, 0, 0, 0)
    return _bands.Cutoffs(tuple(_ti.remaining_time(x, fresh) for x in sizes.edges))
