"""FAIR: plain writes, every socket in one band (what Apache alone does)."""

from __future__ import annotations

import asyncio

from overtake.controller.uplink.flow import UplinkFlow

__all__ = ["FairUplink"]


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

    def describe(self) -> str:
        """One line: what this uplink does."""
        return "fair: no priorities (one FIFO per qdisc band, kernel default)"
