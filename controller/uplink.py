"""Uplink scheduling seam between the gateway and the kernel (papers 000-003).

The gateway (enforcement) writes every response body to its client through an
:class:`UplinkFlow`; the uplink (algorithm) decides *how* those bytes leave: FAIR (plain
writes, the kernel's default sharing), SRPT / SRRT (kernel priority bands chosen per socket from
the remaining bytes or remaining time, paper 001 §3, paper 002 §3), or an application-level
ordering when no qdisc can be installed (paper 000).

Contract used by the gateway::

    flow = uplink.open(writer, total_bytes)   # before the first byte of the response
    await flow.write(chunk)                   # header block and body chunks, in order
    flow.close()                              # exactly once, also on error/disconnect

``total_bytes`` is the size of the whole response (status line + headers + body) when known,
``None`` when streaming without Content-Length; an uplink then treats the flow as large.
``write`` must apply back-pressure (it awaits the writer's drain).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["FairUplink", "Uplink", "UplinkFlow", "make_uplink"]


class UplinkFlow(Protocol):
    """One response on its way to one client."""

    async def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Uplink(Protocol):
    """A policy for the server's uplink: hands out one flow per response."""

    name: str

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow: ...


class _FairFlow:
    __slots__ = ("_writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    def close(self) -> None:
        pass


class FairUplink:
    """Kernel default: every socket in one band (what Apache alone does)."""

    name = "fair"

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow:
        return _FairFlow(writer)


def make_uplink(name: str) -> Uplink:
    """Build the uplink named on the command line (``--uplink``)."""
    if name == "fair":
        return FairUplink()
    raise ValueError(f"uplink: unknown scheduler {name!r}; choose one of: fair")
