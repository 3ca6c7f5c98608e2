"""overtake.controller.uplink: schedulers over real loopback TCP, band detection, fallbacks, SRRT estimate."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from overtake.controller import uplink
from overtake.controller.uplink import qdisc, tcpinfo
from overtake.controller.uplink.errors import UplinkInputError
from overtake.controller.uplink.permits import Permits

REPO = Path(__file__).resolve().parents[3]
IS_ROOT = os.geteuid() == 0


# ---- input errors ----------------------------------------------------------------------------
def test_unknown_scheduler_names_the_choices() -> None:
    with pytest.raises(UplinkInputError, match=r"uplink: unknown scheduler 'sjf'; choose one of: app, fair, srpt, srrt"):
        uplink.make_uplink("sjf")


def test_bad_options_name_the_field() -> None:
    with pytest.raises(UplinkInputError, match="bands"):
        uplink.make_uplink("srpt", bands="prio")
    with pytest.raises(UplinkInputError, match="cutoffs: 2 cutoffs make 3 bands but pfifo_fast has 2"):
        uplink.make_uplink("srpt", bands="pfifo_fast", cutoffs="1K,2K")
    with pytest.raises(UplinkInputError, match="concurrency"):
        uplink.make_uplink("app", concurrency=0)
    with pytest.raises(UplinkInputError, match=r"cutoffs\[0\]"):
        uplink.make_uplink("srrt", bands="pfifo_fast", cutoffs="fast")
    with pytest.raises(UplinkInputError, match="lowest_writers: orders the lowest kernel band, only "
                       "for srpt or srrt, not 'fair'"):
        uplink.make_uplink("fair", lowest_writers=1)
    with pytest.raises(UplinkInputError, match=r"lowest_writers: -1 must be in 0\.\.10000 \(0 = the "
                       r"lowest band is one FIFO; 1 = strict SRPT inside it\)"):
        uplink.make_uplink("srpt", bands="pfifo_fast", lowest_writers=-1)
    with pytest.raises(UplinkInputError, match=r"ordered_bands: 0 must be in 1\.\.8"):
        uplink.make_uplink("srpt", bands="pfifo_fast", lowest_writers=1, ordered_bands=0)
    with pytest.raises(UplinkInputError, match="ordered_bands: 3 needs lowest_writers >= 1"):
        uplink.make_uplink("srpt", bands="pfifo_fast", ordered_bands=3)
    with pytest.raises(UplinkInputError, match=r"ordered_bands: 3 exceeds the 2 data bands in use "
                       r"\(pfifo_fast\); give 1\.\.2"):
        uplink.make_uplink("srpt", bands="pfifo_fast", lowest_writers=1, ordered_bands=3)


def test_fair_is_the_default_uplink() -> None:
    up = uplink.make_uplink("fair")
    assert isinstance(up, uplink.FairUplink) and up.name == "fair"


# ---- SRRT estimate (Al Sa'deh and Yahya, "A new scheduling policy in web servers", eq. 2) --------
def test_remaining_time_closed_form() -> None:
    info = tcpinfo.TcpInfo(1, 0.05, 10, 1448, 0, 0, 0, 0, 0)
    # RTT (1 + RFS / (cwnd MSS)): 0.05 * (1 + 144800 / 14480) = 0.55 s
    assert tcpinfo.remaining_time(144_800, info) == pytest.approx(0.55)
    assert tcpinfo.remaining_time(0, info) == pytest.approx(0.05)
    fresh = tcpinfo.TcpInfo(1, 0.0, 0, 0, 0, 0, 0, 0, 0)  # no RTT sample yet, closed socket
    assert tcpinfo.remaining_time(536, fresh, default_rtt=0.002) == pytest.approx(0.004)


def test_default_srrt_cutoffs_are_the_size_cutoffs_as_times() -> None:
    size = uplink.default_cutoffs(7, by_time=False)
    t = uplink.default_cutoffs(7, by_time=True)
    assert size.edges[0] == pytest.approx(1024) and size.edges[-1] == pytest.approx(51200)
    assert t.edges == pytest.approx(tuple(1e-3 * (1 + x / 14480) for x in size.edges))


# ---- application-level ordering (Crovella et al., "Connection scheduling in web servers") ------
def test_permits_go_to_the_smallest_remaining_first() -> None:
    async def main() -> list[float]:
        p = Permits(1)
        await p.acquire(0)  # held
        order: list[float] = []

        async def waiter(key: float) -> None:
            await p.acquire(key)
            order.append(key)
            p.release()

        tasks = [asyncio.create_task(waiter(k)) for k in (50.0, 1.0, 7.0, 3.0)]
        await asyncio.sleep(0)
        p.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [1.0, 3.0, 7.0, 50.0]


def test_holder_keeps_the_permit_until_a_smaller_flow_waits() -> None:
    async def main() -> list[str]:
        p = Permits(1)
        await p.acquire(100.0)  # a bulk flow holds the only permit
        seen: list[str] = []
        assert p.keep(90.0)  # nobody waits: it goes on
        big = asyncio.create_task(p.acquire(500.0))
        await asyncio.sleep(0)
        assert p.keep(80.0)  # a larger flow waits: still the holder's turn
        small = asyncio.create_task(p.acquire(10.0))
        await asyncio.sleep(0)
        assert not p.keep(70.0)  # a smaller one waits: it gets the permit now
        await small
        seen.append("small")
        assert not big.done()
        p.release()
        await big
        seen.append("big")
        p.release()
        return seen

    assert asyncio.run(main()) == ["small", "big"]


def test_cancelled_waiter_does_not_leak_a_permit() -> None:
    async def main() -> int:
        p = Permits(1)
        await p.acquire(0)
        t = asyncio.create_task(p.acquire(5))
        await asyncio.sleep(0)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        p.release()
        return p._free

    assert asyncio.run(main()) == 1


async def _serve_through(up: Any, sizes: list[int], *, listen_prep: bool = False) -> dict[int, bytes]:
    """Loopback server writing each requested size through ``up``; returns what clients got."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = int((await reader.readline()).strip())
        body = bytes(range(256)) * (n // 256) + bytes(n % 256)
        flow = up.open(writer, n)
        try:
            for off in range(0, n, 65536):
                await flow.write(body[off : off + 65536])
        finally:
            flow.close()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    if listen_prep:
        up.prepare_listener(server.sockets[0])

    async def get(n: int) -> tuple[int, bytes]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"%d\n" % n)
        data = await r.read()
        w.close()
        return n, data

    async with server:
        got = dict(await asyncio.gather(*(get(n) for n in sizes)))
    await asyncio.sleep(0.05)  # let the poller see the last acks
    return got


def _expected(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


def test_app_uplink_delivers_every_byte() -> None:
    sizes = [0, 1, 1000, 300_000, 1_500_000, 70_000]
    up = uplink.make_uplink("app", concurrency=2, quantum=4096)
    got = asyncio.run(_serve_through(up, sizes))
    assert {n: got[n] == _expected(n) for n in sizes} == {n: True for n in sizes}
    assert up.bytes_written == sum(sizes)  # type: ignore[attr-defined]


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
@pytest.mark.parametrize("name", ["srpt", "srrt"])
@pytest.mark.parametrize("bandmap", ["htb", "pfifo_fast"])
def test_kernel_uplink_priorities_stay_in_the_data_bands(
    name: str, bandmap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real = tcpinfo.set_priority

    def spy(sock: Any, prio: int) -> None:
        seen.append(prio)
        real(sock, prio)

    monkeypatch.setattr(tcpinfo, "set_priority", spy)
    up = uplink.make_uplink(name, bands=bandmap, interval=0.002)
    assert isinstance(up, uplink.KernelUplink)
    assert seen == [up.bandmap.data[0]]  # make_uplink's privilege probe on a scratch socket
    seen.clear()
    sizes = [10, 900, 5_000, 60_000, 2_000_000, 400_000]
    got = asyncio.run(_serve_through(up, sizes, listen_prep=True))
    assert all(got[n] == _expected(n) for n in sizes)
    bm = qdisc.HTB_BANDS if bandmap == "htb" else qdisc.PFIFO_FAST_BANDS
    control, data = seen[0], seen[1:]
    assert control == bm.control  # the listener: SYN-ACKs in the control band
    assert data and set(data) <= set(bm.data)  # never the control band, never outside
    st = up.stats()
    assert sum(st.flows_opened.values()) == len(sizes)
    assert all(v == 0 for v in st.active.values())  # every flow finished and was untracked
    if name == "srpt":
        # each flow opened in the band of its total size (the initial cutoffs, 1K..50K)
        assert st.flows_opened == _count(up.cutoffs.band(n) for n in sizes)


def _count(xs: Iterator[int] | Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


# ---- band detection and fallbacks -------------------------------------------------------------
def test_detect_bands_follows_the_installed_qdisc(veth_ns: tuple[str, str]) -> None:
    ns, dev = veth_ns
    up = uplink.make_uplink("srpt", dev=dev, netns=ns)
    assert isinstance(up, uplink.AppUplink) and "no HTB or pfifo_fast qdisc found" in up.describe()
    qdisc.install(dev, netns=ns, mode="htb")
    up = uplink.make_uplink("srpt", dev=dev, netns=ns)
    assert isinstance(up, uplink.KernelUplink) and up.bandmap is qdisc.HTB_BANDS
    assert up.describe().startswith("srpt: HTB, 7 data bands")
    qdisc.install(dev, netns=ns, mode="tbf")
    up = uplink.make_uplink("srrt", dev=dev, netns=ns)
    assert isinstance(up, uplink.KernelUplink) and up.bandmap is qdisc.PFIFO_FAST_BANDS
    assert up.cutoffs.n_bands == 2
    assert uplink.detect_bands(netns=ns) is qdisc.PFIFO_FAST_BANDS  # scan of every interface


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root + setpriv")
def test_unprivileged_srpt_falls_back_to_app_level() -> None:
    work = Path(tempfile.mkdtemp(prefix="ovt_nobody_"))
    os.chmod(work, 0o777)
    code = ("from overtake.controller.uplink import make_uplink; "
            "print(make_uplink('srpt', bands='htb').describe())")  # fmt: skip
    cp = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
         sys.executable, "-c", code],
        capture_output=True, text=True, cwd=work, timeout=60,
        env={"PATH": os.environ.get("PATH", "/usr/bin")},
    )  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("app: application-level SRPT")
    assert "SO_PRIORITY 0x10011 refused: needs CAP_NET_ADMIN" in cp.stdout
    assert "falling back to application-level ordering" in cp.stderr


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
def test_per_band_metrics_add_up_to_what_was_written() -> None:
    from prometheus_client import CollectorRegistry

    from overtake.controller.uplink import UplinkCollector

    up = uplink.make_uplink("srpt", bands="htb", cutoffs="1K,10K,100K")
    sizes = [100, 5_000, 50_000, 500_000, 700]
    asyncio.run(_serve_through(up, sizes))
    reg = CollectorRegistry()
    reg.register(UplinkCollector(up))

    def val(name: str, band: str) -> float:
        v = reg.get_sample_value(name, {"band": band})
        assert v is not None
        return v

    bands7 = [str(b) for b in range(7)]
    assert sum(val("overtake_uplink_bytes_total", b) for b in bands7) == sum(sizes)
    # flows open in the band of their size: 100, 700 -> 0; 5000 -> 1; 50000 -> 2; 500000 -> 3
    assert [val("overtake_uplink_flows_total", b) for b in bands7] == [2, 1, 1, 1, 0, 0, 0]
    assert sum(val("overtake_uplink_active_flows", b) for b in bands7) == 0
    changes = reg.get_sample_value("overtake_uplink_priority_changes_total")
    # climbing bands is timing-dependent on loopback (checked exactly in test_uplink_netns.py)
    assert changes == up.stats().priority_changes
    # no band ordering asked for: no turn-wait series at all
    assert reg.get_sample_value("overtake_uplink_turn_waits_total", {"band": "6"}) is None


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
def test_keep_alive_socket_is_owned_by_its_latest_response() -> None:
    up = uplink.make_uplink("srpt", bands="htb", cutoffs="1K,10K,100K", interval=0.002)
    assert isinstance(up, uplink.KernelUplink)
    sizes = [300_000, 2_000, 80_000]

    async def main() -> bytes:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            owners = []
            for n in sizes:  # three responses back to back on one connection
                await reader.readline()
                flow = up.open(writer, n)
                owners.append(flow)
                assert up._by_sock[writer.get_extra_info("socket").fileno()] is flow
                await flow.write(_expected(n))
                flow.close()
            assert all(f._done for f in owners[:-1])  # earlier responses handed the socket on
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        async with server:
            for _ in sizes:
                w.write(b"x\n")
            data = await r.read()
        w.close()
        await asyncio.sleep(0.05)
        return data

    assert asyncio.run(main()) == b"".join(_expected(n) for n in sizes)
    assert up._by_sock == {} and up._flows == {}
    assert sum(up.stats().flows_opened.values()) == 3


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
def test_top_fraction_sets_how_many_responses_sit_above_the_highest_cutoff() -> None:
    with pytest.raises(UplinkInputError, match=r"top_fraction: 0\.6 must be in \(0, 0\.5\)"):
        uplink.make_uplink("srpt", bands="htb", top_fraction=0.6)
    rng = np.random.default_rng(5)
    sizes = np.exp(rng.normal(7.0, 1.7, 4096))  # lognormal response sizes, bytes
    tops = {}
    for tf in (0.01, 0.001):
        up = uplink.make_uplink("srpt", bands="htb", top_fraction=tf)
        assert isinstance(up, uplink.KernelUplink)
        for x in sizes:
            up._observe(float(x), int(x))  # what every opened flow reports
        edges = up.cutoffs.edges
        # the rule after adapting: lowest at the median, highest with tf of the sizes above it
        assert edges[0] == pytest.approx(np.quantile(sizes, 0.5), rel=1e-9)
        assert np.mean(sizes > edges[-1]) == pytest.approx(tf, abs=1.5 / len(sizes))  # quantile interpolation: +-1 size
        tops[tf] = edges[-1]
    assert tops[0.001] > 2 * tops[0.01]


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
def test_lowest_writers_deliver_everything_and_hand_back_every_turn() -> None:
    # four responses above the top cutoff share the lowest band's one turn (the ordering itself
    # is measured on a shaped link: test_uplink_netns.py); none may be lost or keep a turn
    up = uplink.make_uplink("srpt", bands="htb", cutoffs="1K,10K,100K", interval=0.002,
                            lowest_writers=1)  # fmt: skip
    assert isinstance(up, uplink.KernelUplink) and list(up.ordered) == [3]
    assert "lowest band ordered: 1 writer at a time, least remaining first" in up.describe()
    sizes = [2_000_000, 150_000, 900_000, 500, 1_200_000, 3_000]
    got = asyncio.run(_serve_through(up, sizes))
    assert {n: got[n] == _expected(n) for n in sizes} == {n: True for n in sizes}
    assert list(up._gates) == [3] and up._gates[3]._free == 1 and not up._gates[3]._heap
    assert up._flows == {} and all(v == 0 for v in up.stats().active.values())


@pytest.mark.skipif(not IS_ROOT, reason="SO_PRIORITY >= 7 (HTB classids) needs root/CAP_NET_ADMIN")
def test_ordered_bands_each_hand_back_every_turn_and_count_waits_per_band() -> None:
    # the lowest three bands (1: 1K-10K, 2: 10K-100K, 3: above) each have one turn; responses
    # climb from band 3 through 2 and 1 as they drain, taking and returning a turn in each
    up = uplink.make_uplink("srpt", bands="htb", cutoffs="1K,10K,100K", interval=0.002,
                            lowest_writers=1, ordered_bands=3)  # fmt: skip
    assert isinstance(up, uplink.KernelUplink) and list(up.ordered) == [1, 2, 3]
    assert "lowest 3 bands ordered: 1 writer at a time in each, least remaining first" in up.describe()
    sizes = [2_000_000, 150_000, 900_000, 500, 60_000, 1_200_000, 3_000, 40_000, 7_000]
    got = asyncio.run(_serve_through(up, sizes))
    assert {n: got[n] == _expected(n) for n in sizes} == {n: True for n in sizes}
    assert {b: (g._free, len(g._heap)) for b, g in up._gates.items()} == {b: (1, 0) for b in (1, 2, 3)}
    assert up._flows == {} and all(v == 0 for v in up.stats().active.values())
    from prometheus_client import CollectorRegistry

    from overtake.controller.uplink import UplinkCollector

    reg = CollectorRegistry()
    reg.register(UplinkCollector(up))
    waits = {b: reg.get_sample_value("overtake_uplink_turn_waits_total", {"band": str(b)})
             for b in range(7)}  # fmt: skip
    # a series for each ordered band only, equal to the scheduler's own count
    assert waits == {b: (up.stats().turn_waits.get(b, 0) if b in (1, 2, 3) else None) for b in range(7)}


def test_sidecar_refuses_cutoffs_without_a_band_scheduler() -> None:
    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar
    from overtake.controller.sidecar.stages import load_stages

    table = load_stages(REPO / "examples" / "sidecar" / "stages.yaml")
    opts = SidecarOptions.from_flat(policy="pi(1)", apache="http://127.0.0.1:9", listen="127.0.0.1:9",
                          uplink="fair", uplink_cutoffs="1K,4K")  # fmt: skip
    with pytest.raises(UplinkInputError, match="uplink_cutoffs: only for --uplink srpt or srrt"):
        Sidecar(table, opts)
