"""Two network namespaces joined by a veth pair, the server side's egress shaped.

    client ns  [veth C 10.x.y.2] <----> [veth S 10.x.y.1]  server ns
                                         egress: HTB (8 strict classes, TSO/GSO off)
                                         or TBF + pfifo_fast, at --rate

Names are unique per process (netns and veth names are global on the host); ``down()`` always
deletes both namespaces, which destroys the veth pair and every qdisc on it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass

from overtake.controller.uplink import qdisc


def sh(*cmd: str) -> str:
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {cp.stderr.strip()}")
    return cp.stdout


@dataclass
class Testbed:
    srv_ns: str
    cli_ns: str
    srv_dev: str
    cli_dev: str
    srv_ip: str
    cli_ip: str
    mode: str | None = None
    rate: str = "10mbit"

    @classmethod
    def up(cls, *, rate: str = "10mbit", mode: str = "htb", tag: str | None = None,
           floor: float = 0.0) -> Testbed:
        tag = tag or uuid.uuid4().hex[:6]
        octet = int(tag[:2], 16) % 250 + 1
        tb = cls(f"ovt_s_{tag}", f"ovt_c_{tag}", f"ovs{tag}", f"ovc{tag}",
                 f"10.213.{octet}.1", f"10.213.{octet}.2")  # fmt: skip
        try:
            sh("ip", "netns", "add", tb.srv_ns)
            sh("ip", "netns", "add", tb.cli_ns)
            sh("ip", "link", "add", tb.srv_dev, "type", "veth", "peer", "name", tb.cli_dev)
            sh("ip", "link", "set", tb.srv_dev, "netns", tb.srv_ns)
            sh("ip", "link", "set", tb.cli_dev, "netns", tb.cli_ns)
            sh("ip", "-n", tb.srv_ns, "addr", "add", f"{tb.srv_ip}/30", "dev", tb.srv_dev)
            sh("ip", "-n", tb.cli_ns, "addr", "add", f"{tb.cli_ip}/30", "dev", tb.cli_dev)
            for ns, dev in ((tb.srv_ns, tb.srv_dev), (tb.cli_ns, tb.cli_dev)):
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "link", "set", dev, "up")
            # a large accept backlog: under overload FAIR must not lose SYNs to a small queue
            for ns in (tb.srv_ns, tb.cli_ns):
                sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.core.somaxconn=4096")
                sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_max_syn_backlog=4096")
            res = qdisc.install(tb.srv_dev, mode=mode, rate=rate, netns=tb.srv_ns, floor=floor)
            tb.mode, tb.rate = res.mode, rate
        except BaseException:
            tb.down()
            raise
        return tb

    def set_floor(self, floor: float) -> None:
        """Re-install the server's qdisc with the lowest band guaranteed ``floor`` of the rate."""
        qdisc.install(self.srv_dev, mode=self.mode or "htb", rate=self.rate, netns=self.srv_ns,
                      floor=floor)  # fmt: skip

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def down(self) -> None:
        for ns in (self.srv_ns, self.cli_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":  # pragma: no cover - manual check
    tb = Testbed.up()
    print(tb, qdisc.show(tb.srv_dev, netns=tb.srv_ns).describe())
    tb.down()
    print("down", os.getpid())
