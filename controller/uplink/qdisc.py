"""Install, inspect and remove the uplink's priority qdisc on one interface.

Harchol-Balter et al., "Size-based scheduling to improve web performance" §2.1 drains the server's
socket buffers into the NIC through a 16-band ``prio`` qdisc. Kernels built without
``CONFIG_NET_SCH_PRIO`` (the project's test kernel, 6.18, also
lacks fq and netem and loads no modules) refuse it, so two arrangements are supported and probed
in this order:

``htb``  HTB shaper at ``rate`` with 8 strict-priority leaves ``1:10`` .. ``1:17`` (HTB ``prio``
         0..7), each a ``pfifo``. HTB classifies on ``skb->priority`` directly, so a socket's
         ``SO_PRIORITY = 0x00010010 + b`` selects leaf ``1:1b`` without filters (tc minors are
         hex; a priority that is no leaf's classid goes through filters, then ``default``).
         Unclassified packets (SYN-ACKs, pure ACKs) go to ``default 10``, the top class: the
         control band of Harchol-Balter et al. §2.2.3. TSO/GSO are turned off (``ethtool -K``) because
         HTB does not segment 64 KB GSO packets, which would block a 10 Mbit/s link for ~50 ms.
         Priorities >= 7 need CAP_NET_ADMIN or CAP_NET_RAW in the server process.
         ``floor`` > 0 guarantees the lowest data band (the largest remaining responses) that
         fraction of ``rate`` as its HTB ``rate``: HTB serves a class below its own rate before
         any class borrows, so a large response keeps moving while small ones arrive and its
         segments do not sit in the qdisc past TCP's retransmission timeout (an RTO there
         backs the flow off and cuts its window even though nothing was lost).
``tbf``  TBF shaper with a ``pfifo_fast`` child: 3 bands via the fixed priomap
         (``band = priomap[priority & 15]``; TBF segments GSO packets itself):
         SO_PRIORITY 6 -> band 0 (control), 0 -> band 1, 1 -> band 2. Reachable unprivileged.

Installation is idempotent (``tc ... replace``; a matching setup is left untouched) and every
function can return the ``tc`` command lines instead of running them (``dry_run``). Without
CAP_NET_ADMIN nothing is installed: :class:`QdiscPermissionError` says so, and the sidecar
falls back to ordering its own writes (``--uplink app``, Crovella et al., "Connection scheduling in web servers").
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from overtake.controller.uplink.errors import QdiscError, QdiscPermissionError, UplinkInputError

__all__ = [
    "HTB_BANDS",
    "MODES",
    "PFIFO_FAST_BANDS",
    "BandMap",
    "ClassStats",
    "InstallResult",
    "QdiscState",
    "has_net_admin",
    "install",
    "parse_rate",
    "plan_install",
    "plan_remove",
    "remove",
    "show",
]

MODES = ("htb", "tbf")
CAP_NET_ADMIN = 12
_MTU_FRAME = 1514  # Ethernet frame incl. header: HTB/TBF account L2 bytes
HTB_LEAVES = 8  # HTB has 8 priorities (TC_HTB_NUMPRIO)
_NO_FLOOR_BPS = 8_000  # HTB needs a rate per class; 8 kbit is "none" at any real link speed
MAX_FLOOR = 0.5


@dataclass(frozen=True)
class BandMap:
    """SO_PRIORITY values of one arrangement: the control band, then data bands high -> low."""

    kind: str
    control: int
    data: tuple[int, ...]

    @property
    def all(self) -> tuple[int, ...]:
        """Every priority this arrangement may set (control first)."""
        return (self.control, *self.data)

    def describe(self) -> str:
        """One line: which bands and which SO_PRIORITY values."""
        if self.kind == "htb":
            return (
                f"HTB, {len(self.data)} data bands (classes 1:11..1:1{len(self.data)}, "
                f"SO_PRIORITY {self.data[0]:#x}..{self.data[-1]:#x}), control class 1:10 "
                "(SYN-ACKs, default)"
            )
        if self.kind == "pfifo_fast":
            return (
                f"pfifo_fast priomap, {len(self.data)} data bands (SO_PRIORITY "
                f"{', '.join(map(str, self.data))}), control band 0 (SO_PRIORITY {self.control})"
            )
        return f"{self.kind}: no kernel bands"


HTB_BANDS = BandMap("htb", 0x10010, tuple(0x10011 + i for i in range(HTB_LEAVES - 1)))
PFIFO_FAST_BANDS = BandMap("pfifo_fast", 6, (0, 1))

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|)\s*$", re.IGNORECASE)
_RATE_SCALE = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: str | int) -> int:
    """``'10mbit'`` -> 10_000_000 bits/s (tc units; plain numbers are bits/s)."""
    m = _RATE.match(str(text))
    if m is None:
        raise UplinkInputError(
            f"rate: cannot read {text!r}; write bits per second like '10mbit', '500kbit', '1gbit'"
        )
    bps = int(float(m.group(1)) * _RATE_SCALE[m.group(2).lower()])
    if not 8_000 <= bps <= 100 * 10**9:
        raise UplinkInputError(f"rate: {text!r} = {bps} bit/s is outside 8kbit..100gbit")
    return bps


@dataclass(frozen=True)
class ClassStats:
    """Counters of one HTB leaf (or the TBF root), from ``tc -s -j class show``."""

    classid: str
    prio: int | None
    bytes: int
    packets: int
    drops: int


@dataclass(frozen=True)
class QdiscState:
    """What is installed on ``dev``: ``mode`` is ``'htb'``/``'tbf'`` when it is our layout."""

    dev: str
    netns: str | None
    mode: str | None
    root_kind: str | None
    rate_bps: int | None
    bands: BandMap | None
    classes: tuple[ClassStats, ...]
    gso_off: bool | None
    raw: list[dict[str, Any]] = field(repr=False, default_factory=list)
    floor_bps: int | None = None  # HTB rate of the lowest data band (8 kbit = no floor)

    def describe(self) -> str:
        """One line for humans."""
        where = f"{self.dev}" + (f" (netns {self.netns})" if self.netns else "")
        if self.mode is None:
            return f"{where}: no uplink qdisc (root: {self.root_kind or 'none'})"
        rate = f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "?"
        gso = {True: "TSO/GSO off", False: "TSO/GSO ON", None: "TSO/GSO unknown"}[self.gso_off]
        assert self.bands is not None
        floor = ""
        if self.mode == "htb" and self.floor_bps and self.floor_bps > _NO_FLOOR_BPS:
            share = f" = {self.floor_bps / self.rate_bps:.0%}" if self.rate_bps else ""
            floor = f"; lowest band guaranteed {self.floor_bps / 1e6:g} Mbit/s{share}"
        return f"{where}: {self.mode} at {rate}, {self.bands.describe()}{floor}; {gso}"


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install` / :func:`remove` did (or would do, with ``dry_run``)."""

    dev: str
    netns: str | None
    mode: str | None
    commands: tuple[tuple[str, ...], ...]
    changed: bool
    dry_run: bool
    note: str = ""

    def script(self) -> str:
        """The commands as shell lines."""
        return "\n".join(shlex.join(c) for c in self.commands)


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


def has_net_admin() -> bool:
    """True when this process holds CAP_NET_ADMIN in its effective set."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def _tc(netns: str | None) -> list[str]:
    return ["tc", "-n", netns] if netns else ["tc"]


def _nsexec(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def _burst(bps: int) -> int:
    # >= 2 frames, and >= 1 ms of data so the shaper reaches its rate at high speeds
    return max(2 * _MTU_FRAME, bps // 8 // 1000)


def _check_dev(dev: str) -> None:
    if not dev or len(dev) > 15 or not re.fullmatch(r"[A-Za-z0-9_.:@-]+", dev):
        raise UplinkInputError(
            f"dev: {dev!r} is not an interface name; give one from `ip link` (<= 15 chars)"
        )


def plan_install(dev: str, *, mode: str = "htb", rate: str | int = "10mbit", netns: str | None = None,
                 leaf_limit: int = 1000, floor: float = 0.0) -> list[list[str]]:
    """The command lines that install ``mode`` on ``dev`` (nothing is run)."""
    _check_dev(dev)
    if mode not in MODES:
        raise UplinkInputError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if not 1 <= leaf_limit <= 100_000:
        raise UplinkInputError(f"leaf_limit: {leaf_limit} packets must be in 1..100000")
    bps = parse_rate(rate)
    floor_bps = _floor_bps(floor, bps, mode)
    burst = _burst(bps)
    tc = _tc(netns)
    if mode == "htb":
        ceil = max(10**9, 10 * bps)  # leaf ceil >> parent rate, else leaves hit their own ceil
        cmds = [
            [*_nsexec(netns), "ethtool", "-K", dev, "tso", "off", "gso", "off"],
            [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            [*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst)],
        ]  # fmt: skip
        for p in range(HTB_LEAVES):
            floored = p == HTB_LEAVES - 1 and floor_bps > _NO_FLOOR_BPS
            leaf_rate = f"{floor_bps}bit" if floored else "8kbit"
            cmds.append(
                [*tc, "class", "replace", "dev", dev, "parent", "1:1", "classid", f"1:1{p}",
                 "htb", "rate", leaf_rate, "ceil", f"{ceil}bit", "prio", str(p),
                 "quantum", str(_MTU_FRAME), "burst", str(_MTU_FRAME),
                 "cburst", str(_MTU_FRAME)]  # fmt: skip
            )
            cmds.append(
                [*tc, "qdisc", "replace", "dev", dev, "parent", f"1:1{p}", "handle", f"1{p}:",
                 "pfifo", "limit", str(leaf_limit)]  # fmt: skip
            )
        return cmds
    return [
        [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{bps}bit",
         "burst", str(burst), "limit", str(leaf_limit * _MTU_FRAME)],
        [*tc, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "pfifo_fast"],
    ]  # fmt: skip


def _floor_bps(floor: float, bps: int, mode: str) -> int:
    if not (isinstance(floor, (int, float)) and 0.0 <= floor <= MAX_FLOOR):
        raise UplinkInputError(
            f"floor: {floor!r} must be a fraction of the rate in 0..{MAX_FLOOR} (e.g. 0.05 "
            "guarantees the lowest band 5%); 0 is strict priority"
        )
    if floor > 0 and mode != "htb":
        raise UplinkInputError(
            f"floor: {floor} needs mode htb (pfifo_fast bands are strict); use --floor 0 "
            "with tbf"
        )
    return max(_NO_FLOOR_BPS, int(round(floor * bps)))


def plan_remove(dev: str, *, netns: str | None = None) -> list[list[str]]:
    """The command that removes the root qdisc (the interface returns to its default)."""
    _check_dev(dev)
    return [[*_tc(netns), "qdisc", "del", "dev", dev, "root"]]


def _json(run: Runner, cmd: list[str], dev: str, netns: str | None) -> list[dict[str, Any]]:
    cp = run(cmd)
    if cp.returncode != 0:
        msg = (cp.stderr or cp.stdout).strip()
        if "Cannot find device" in msg or "does not exist" in msg or "No such device" in msg:
            where = f" in netns {netns}" if netns else ""
            raise UplinkInputError(
                f"dev: interface {dev!r} not found{where}; list interfaces with `ip link`"
            )
        if "Invalid netns" in msg or "Cannot open network namespace" in msg:
            raise UplinkInputError(f"netns: {netns!r} not found; list with `ip netns list`")
        raise QdiscError(f"{shlex.join(cmd)} failed: {msg}")
    text = cp.stdout.strip()
    out: list[dict[str, Any]] = json.loads(text) if text else []
    return out


def _gso_off(dev: str, netns: str | None, run: Runner) -> bool | None:
    if shutil.which("ethtool") is None:
        return None
    cp = run([*_nsexec(netns), "ethtool", "-k", dev])
    if cp.returncode != 0:
        return None
    feats = dict(
        (k.strip(), v.split()[0]) for k, v in (ln.split(":", 1) for ln in cp.stdout.splitlines()[1:] if ":" in ln) if v.split()
    )  # fmt: skip
    return (
        feats.get("tcp-segmentation-offload") == "off"
        and feats.get("generic-segmentation-offload") == "off"
    )


def show(dev: str, *, netns: str | None = None, run: Runner = _run) -> QdiscState:
    """Inspect ``dev``: which arrangement (if any) is installed, its rate and leaf counters."""
    _check_dev(dev)
    tc = _tc(netns)
    qdiscs = _json(run, [*tc, "-j", "qdisc", "show", "dev", dev], dev, netns)
    root = next((q for q in qdiscs if q.get("root")), None)
    root_kind = root.get("kind") if root else None
    mode: str | None = None
    rate: int | None = None
    floor_bps: int | None = None
    classes: list[ClassStats] = []
    bands: BandMap | None = None
    if root is not None and root.get("handle") == "1:" and root_kind == "htb":
        leaves = _htb_classes(run, [*tc, "-s", "class", "show", "dev", dev])
        want = [f"1:1{p}" for p in range(HTB_LEAVES)]
        if all(w in leaves for w in want) and "1:1" in leaves:
            mode, bands = "htb", HTB_BANDS
            rate = leaves["1:1"][1]
            floor_bps = leaves[want[-1]][1]
            classes = [leaves[w][0] for w in want]
    elif root is not None and root.get("handle") == "1:" and root_kind == "tbf":
        child = next((q for q in qdiscs if q.get("parent") == "1:1"), None)
        if child is not None and child.get("kind") == "pfifo_fast":
            mode, bands = "tbf", PFIFO_FAST_BANDS
            rate = int(root.get("options", {}).get("rate", 0)) * 8 or None
            st = _json(run, [*tc, "-s", "-j", "qdisc", "show", "dev", dev], dev, netns)
            r = next((q for q in st if q.get("root")), {})
            classes = [_stats("1:", r)]
    gso = _gso_off(dev, netns, run) if mode == "htb" else None
    return QdiscState(dev, netns, mode, root_kind, rate, bands, tuple(classes), gso, qdiscs,
                      floor_bps)


_CLASS = re.compile(r"^class htb (\S+) .*?(?:prio (\d+) )?rate (\S+)")
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)")


def _htb_classes(run: Runner, cmd: list[str]) -> dict[str, tuple[ClassStats, int]]:
    # iproute2 6.1 has no JSON for HTB classes: parse `tc -s class show` text blocks
    cp = run(cmd)
    if cp.returncode != 0:
        raise QdiscError(f"{shlex.join(cmd)} failed: {(cp.stderr or cp.stdout).strip()}")
    out: dict[str, tuple[ClassStats, int]] = {}
    cur: tuple[str, int | None, int] | None = None
    for line in cp.stdout.splitlines():
        m = _CLASS.match(line.strip())
        if m:
            cur = (m.group(1), int(m.group(2)) if m.group(2) else None, _tc_rate(m.group(3)))
            continue
        s = _SENT.search(line)
        if s and cur is not None:
            cid, prio, rate = cur
            stats = ClassStats(cid, prio, int(s.group(1)), int(s.group(2)), int(s.group(3)))
            out[cid] = (stats, rate)
            cur = None
    return out


def _tc_rate(text: str) -> int:
    m = re.fullmatch(r"([0-9.]+)([KMG]?)bit", text)
    if m is None:
        return 0
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2)])


def _stats(classid: str, q: dict[str, Any]) -> ClassStats:
    return ClassStats(
        classid=classid,
        prio=None,
        bytes=int(q.get("bytes", 0)),
        packets=int(q.get("packets", 0)),
        drops=int(q.get("drops", 0)),
    )


def _matches(state: QdiscState, mode: str, bps: int, floor_bps: int = _NO_FLOOR_BPS) -> bool:
    if state.mode != mode or state.rate_bps is None:
        return False
    # tc rounds rates to its internal units; within 1% is "the same rate"
    same_rate = abs(state.rate_bps - bps) <= 0.01 * bps
    if mode == "tbf":
        return same_rate
    same_floor = state.floor_bps is not None and abs(state.floor_bps - floor_bps) <= max(
        0.01 * floor_bps, 1000)
    return same_rate and same_floor and state.gso_off is True


def install(
    dev: str,
    *,
    mode: str = "auto",
    rate: str | int = "10mbit",
    netns: str | None = None,
    leaf_limit: int = 1000,
    floor: float = 0.0,
    dry_run: bool = False,
    run: Runner = _run,
    net_admin: Callable[[], bool] = has_net_admin,
) -> InstallResult:
    """Install the uplink qdisc on ``dev`` (``mode`` ``auto`` probes HTB, then TBF).

    Idempotent: when the same arrangement at the same rate is already there, nothing runs.
    ``dry_run`` returns the commands without running anything (no privileges needed).
    Raises :class:`QdiscPermissionError` without CAP_NET_ADMIN, :class:`QdiscError` when
    neither arrangement can be built.
    """
    if mode not in ("auto", *MODES):
        raise UplinkInputError(f"mode: {mode!r} is not one of auto, {', '.join(MODES)}")
    bps = parse_rate(rate)
    first = "htb" if mode == "auto" else mode
    floor_bps = _floor_bps(floor, bps, first)
    if dry_run:
        cmds = plan_install(dev, mode=first, rate=bps, netns=netns, leaf_limit=leaf_limit,
                            floor=floor)  # fmt: skip
        note = "auto: HTB first; TBF + pfifo_fast if the kernel lacks HTB" if mode == "auto" else ""
        return InstallResult(dev, netns, first, _tuples(cmds), False, True, note)
    if not net_admin():
        raise QdiscPermissionError(
            f"dev {dev}: installing a qdisc needs CAP_NET_ADMIN (run as root or with "
            "`setcap cap_net_admin+ep`); falling back: run the sidecar with --uplink app "
            "(application-level ordering, Crovella et al.)"
        )
    state = show(dev, netns=netns, run=run)
    tried = _arrangements(mode, first, state, bps)
    errors: list[str] = []
    for m in tried:
        if _matches(state, m, bps, floor_bps):
            return InstallResult(dev, netns, m, (), False, False, "already installed")
        cmds = _install_commands(dev, m, state, bps, netns, leaf_limit, floor)
        if m == "htb" and shutil.which("ethtool") is None:
            errors.append("htb: ethtool not installed (needed to turn TSO/GSO off)")
            continue
        failed = _run_all(cmds, run)
        if failed is None:
            return _installed(dev, netns, m, cmds, floor, run)
        errors.append(f"{m}: {failed}")
        if "kind is unknown" not in failed:
            break  # only a kernel without the qdisc moves auto on to the next arrangement
    raise QdiscError(f"dev {dev}: could not install {' or '.join(tried)}: " + "; ".join(errors))


def _arrangements(mode: str, first: str, state: QdiscState, bps: int) -> list[str]:
    """The arrangements to try in order: the one asked for; under auto HTB then TBF, or the one
    already installed at this rate (so a re-run keeps what is there)."""
    if mode != "auto":
        return [first]
    if state.mode is not None and abs((state.rate_bps or 0) - bps) <= 0.01 * bps:
        return [state.mode]
    return ["htb", "tbf"]


def _install_commands(dev: str, m: str, state: QdiscState, bps: int, netns: str | None, leaf_limit: int,
                      floor: float) -> list[list[str]]:
    """The tc commands that build arrangement ``m``, preceded by the root's removal where
    ``replace`` cannot change it (another kind of root, or an HTB root's parameters)."""
    cmds = plan_install(dev, mode=m, rate=bps, netns=netns, leaf_limit=leaf_limit,
                        floor=floor if m == "htb" else 0.0)  # fmt: skip
    root = next((q for q in state.raw if q.get("root")), {})
    if state.root_kind not in (None, "noqueue") and root.get("handle") != "0:":
        # `replace` can neither change the root's kind nor an HTB root's parameters
        cmds = plan_remove(dev, netns=netns) + cmds
    return cmds


def _installed(dev: str, netns: str | None, m: str, cmds: list[list[str]], floor: float,
               run: Runner) -> InstallResult:
    """The arrangement is built: HTB also needs TSO/GSO off; a floor has no effect under TBF."""
    if m == "htb" and _gso_off(dev, netns, run) is False:
        raise QdiscError(f"dev {dev}: TSO/GSO still on after `ethtool -K`; HTB needs "
                         "them off (it does not segment 64 KB GSO packets, which hold "
                         "the link for ~50 ms at 10 Mbit/s)")
    note = (f"floor {floor} not applied: tbf's pfifo_fast bands are strict priorities"
            if m == "tbf" and floor > 0 else "")
    return InstallResult(dev, netns, m, _tuples(cmds), True, False, note)


def _run_all(cmds: list[list[str]], run: Runner) -> str | None:
    for c in cmds:
        cp = run(c)
        if cp.returncode != 0:
            msg = (cp.stderr or cp.stdout).strip()
            if "ethtool" in c and "Could not change any device features" in msg:
                continue  # already off: ethtool exits 1 when nothing changes
            return f"`{shlex.join(c)}`: {msg}"
    return None


def _cleanup(dev: str, netns: str | None, run: Runner) -> None:
    for c in plan_remove(dev, netns=netns):
        run(c)


def _tuples(cmds: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(c) for c in cmds)


def remove(
    dev: str,
    *,
    netns: str | None = None,
    dry_run: bool = False,
    run: Runner = _run,
    net_admin: Callable[[], bool] = has_net_admin,
) -> InstallResult:
    """Remove our root qdisc from ``dev``; a no-op when none of ours is installed.

    TSO/GSO stay off (turn them on with ``ethtool -K DEV tso on gso on`` if wanted).
    """
    cmds = plan_remove(dev, netns=netns)
    if dry_run:
        return InstallResult(dev, netns, None, _tuples(cmds), False, True)
    if not net_admin():
        raise QdiscPermissionError(
            f"dev {dev}: removing a qdisc needs CAP_NET_ADMIN (run as root)"
        )
    state = show(dev, netns=netns, run=run)
    if state.mode is None:
        return InstallResult(dev, netns, None, (), False, False, "nothing to remove")
    failed = _run_all(cmds, run)
    if failed is not None:
        raise QdiscError(f"dev {dev}: {failed}")
    return InstallResult(dev, netns, state.mode, _tuples(cmds), True, False)
