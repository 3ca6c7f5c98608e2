"""overtake.controller.uplink.qdisc and ``overtake uplink``: real qdiscs in namespaces the tests create.

Root is needed for ``ip netns add``; without it the namespace tests skip with that reason.
The CAP_NET_ADMIN fallback is checked both by injection and by running the CLI as ``nobody``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from overtake.api import cli
from overtake.controller.uplink import qdisc
from overtake.controller.uplink.errors import QdiscPermissionError, UplinkInputError

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: ip netns add / tc qdisc")


def test_parse_rate() -> None:
    assert qdisc.parse_rate("10mbit") == 10_000_000
    assert qdisc.parse_rate("500Kbit") == 500_000
    assert qdisc.parse_rate(2_000_000) == 2_000_000
    for bad in ("10mbps", "fast", "1bit"):
        with pytest.raises(UplinkInputError, match="rate"):
            qdisc.parse_rate(bad)


def test_dry_run_htb_commands() -> None:
    res = qdisc.install("eth9", mode="htb", rate="10mbit", dry_run=True, net_admin=lambda: False)
    lines = res.script().splitlines()
    assert res.dry_run and not res.changed
    assert lines[0] == "ethtool -K eth9 tso off gso off"
    assert lines[1] == "tc qdisc replace dev eth9 root handle 1: htb default 10"
    assert lines[2] == ("tc class replace dev eth9 parent 1: classid 1:1 htb rate 10000000bit "
                        "ceil 10000000bit burst 3028 cburst 3028")  # fmt: skip
    # 8 leaves 1:10..1:17 with HTB prio 0..7 and a pfifo each: 3 + 16 lines
    assert len(lines) == 19
    for p in range(8):
        assert (f"tc class replace dev eth9 parent 1:1 classid 1:1{p} htb rate 8kbit "
                f"ceil 1000000000bit prio {p} quantum 1514 burst 1514 cburst 1514") in lines  # fmt: skip
        assert f"tc qdisc replace dev eth9 parent 1:1{p} handle 1{p}: pfifo limit 1000" in lines


def test_dry_run_tbf_in_netns() -> None:
    res = qdisc.install("v0", mode="tbf", rate="20mbit", netns="x", dry_run=True)
    assert res.script().splitlines() == [
        "tc -n x qdisc replace dev v0 root handle 1: tbf rate 20000000bit burst 3028 limit 1514000",
        "tc -n x qdisc replace dev v0 parent 1:1 handle 10: pfifo_fast",
    ]


def test_band_maps() -> None:
    # HTB picks the leaf whose classid equals skb->priority; 1:10 (control) is the default class
    assert qdisc.HTB_BANDS.control == 0x10010
    assert qdisc.HTB_BANDS.data == tuple(range(0x10011, 0x10018))
    # pfifo_fast priomap 1 2 2 2 1 2 0 0 ...: prio 6 -> band 0, 0 -> band 1, 1 -> band 2
    assert qdisc.PFIFO_FAST_BANDS.all == (6, 0, 1)


def test_cli_dry_run_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["uplink", "install", "--dev", "eth9", "--mode", "tbf", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tc qdisc replace dev eth9 root handle 1: tbf rate 10000000bit")
    assert cli.main(["uplink", "install", "--dev", "eth9", "--rate", "10MB", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rate:" in err[0] and "10mbit" in err[0]


def test_missing_cap_net_admin_is_reported_with_the_fallback() -> None:
    calls: list[list[str]] = []

    def run(cmd):  # type: ignore[no-untyped-def]
        calls.append(list(cmd))
        raise AssertionError("nothing may run without CAP_NET_ADMIN")

    with pytest.raises(QdiscPermissionError, match="CAP_NET_ADMIN.*--uplink app"):
        qdisc.install("eth9", run=run, net_admin=lambda: False)
    assert calls == []


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) missing")
def test_cli_as_unprivileged_user_falls_back() -> None:
    # nobody cannot write numba's cache next to fitting/ (imported by the CLI): give it one
    work = Path(tempfile.mkdtemp(prefix="ovt_nobody_"))
    os.chmod(work, 0o777)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NUMBA_CACHE_DIR": str(work / "nb")}
    cp = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
         sys.executable, "-m", "overtake.api.cli", "uplink", "install", "--dev", "lo"],
        capture_output=True, text=True, cwd=work, env=env, timeout=120,
    )  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    assert cp.returncode == 1, cp.stderr
    assert "CAP_NET_ADMIN" in cp.stderr and "--uplink app" in cp.stderr


@needs_root
def test_install_show_idempotent_switch_and_remove(veth_ns: tuple[str, str]) -> None:
    ns, dev = veth_ns
    r1 = qdisc.install(dev, netns=ns, rate="10mbit")
    assert (r1.mode, r1.changed) == ("htb", True)
    st = qdisc.show(dev, netns=ns)
    assert st.mode == "htb" and st.rate_bps == 10_000_000 and st.gso_off is True
    assert [c.classid for c in st.classes] == [f"1:1{p}" for p in range(8)]
    assert [c.prio for c in st.classes] == list(range(8))
    r2 = qdisc.install(dev, netns=ns, rate="10mbit")
    assert (r2.changed, r2.commands, r2.note) == (False, (), "already installed")
    # another rate: reinstalled in place
    assert qdisc.install(dev, netns=ns, rate="20mbit").changed
    assert qdisc.show(dev, netns=ns).rate_bps == 20_000_000
    # switch to TBF + pfifo_fast: `replace` cannot change the root kind, so it deletes first
    r3 = qdisc.install(dev, netns=ns, rate="10mbit", mode="tbf")
    assert r3.changed and r3.commands[0][-5:] == ("qdisc", "del", "dev", dev, "root")
    st = qdisc.show(dev, netns=ns)
    assert (st.mode, st.rate_bps, st.bands) == ("tbf", 10_000_000, qdisc.PFIFO_FAST_BANDS)
    assert not qdisc.install(dev, netns=ns, rate="10mbit", mode="tbf").changed
    rm = qdisc.remove(dev, netns=ns)
    assert rm.changed and qdisc.show(dev, netns=ns).mode is None
    again = qdisc.remove(dev, netns=ns)
    assert (again.changed, again.note) == (False, "nothing to remove")


@needs_root
def test_cli_install_show_remove(veth_ns: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    ns, dev = veth_ns
    assert cli.main(["uplink", "install", "--dev", dev, "--netns", ns, "--mode", "htb"]) == 0
    out = capsys.readouterr().out
    assert "installed htb" in out and "7 data bands" in out and "TSO/GSO off" in out
    assert cli.main(["uplink", "install", "--dev", dev, "--netns", ns, "--mode", "htb"]) == 0
    assert "already installed" in capsys.readouterr().out
    assert cli.main(["uplink", "show", "--dev", dev, "--netns", ns]) == 0
    assert "1:17 prio 7" in capsys.readouterr().out
    assert cli.main(["uplink", "remove", "--dev", dev, "--netns", ns]) == 0
    assert cli.main(["uplink", "remove", "--dev", dev, "--netns", ns]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert cli.main(["uplink", "show", "--dev", "nope0", "--netns", ns]) == 2
    err = capsys.readouterr().err
    assert "dev: interface 'nope0' not found" in err


def test_floor_sets_the_lowest_band_rate_and_bad_floors_name_the_field() -> None:
    res = qdisc.install("eth9", mode="htb", rate="10mbit", floor=0.05, dry_run=True)
    leaves = [ln for ln in res.script().splitlines() if "classid 1:1" in ln and "parent 1:1 " in ln]
    assert len(leaves) == 8
    # only the lowest data band 1:17 is guaranteed 5% of 10 Mbit/s; the others keep 8 kbit
    assert [ln.split(" rate ")[1].split()[0] for ln in leaves] == ["8kbit"] * 7 + ["500000bit"]
    for bad in (-0.1, 0.6, float("nan")):
        with pytest.raises(UplinkInputError, match="floor: .* 0..0.5"):
            qdisc.plan_install("eth9", floor=bad)
    with pytest.raises(UplinkInputError, match="floor: .*needs mode htb"):
        qdisc.install("eth9", mode="tbf", floor=0.1, dry_run=True)


def test_cli_floor_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["uplink", "install", "--dev", "eth9", "--floor", "0.9", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "floor:" in err[0] and "0.05" in err[0]


@needs_root
def test_floor_is_installed_shown_and_idempotent(veth_ns: tuple[str, str]) -> None:
    ns, dev = veth_ns
    assert qdisc.install(dev, netns=ns, rate="10mbit", floor=0.2).changed
    st = qdisc.show(dev, netns=ns)
    assert st.floor_bps == 2_000_000 and "lowest band guaranteed 2 Mbit/s = 20%" in st.describe()
    assert not qdisc.install(dev, netns=ns, rate="10mbit", floor=0.2).changed
    # back to strict priority: a change, and the leaf returns to the nominal 8 kbit
    assert qdisc.install(dev, netns=ns, rate="10mbit", floor=0.0).changed
    st = qdisc.show(dev, netns=ns)
    assert st.floor_bps == 8_000 and "guaranteed" not in st.describe()
