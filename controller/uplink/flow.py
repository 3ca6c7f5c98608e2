"""What the gateway writes responses through: one uplink flow per response (:mod:`overtake.controller.uplink`
for the papers).

The gateway (enforcement) writes every response body to its client through an
:class:`UplinkFlow`; the :class:`Uplink` (algorithm) decides *how* those bytes leave. Contract
used by the gateway::

    flow = uplink.open(writer, total_bytes)   # before the first byte of the response
    await flow.write(chunk)                   # header block and body chunks, in order
    flow.close()                              # exactly once, also on error/disconnect

``total_bytes`` is the size of the whole response (status line + headers + body) when known,
``None`` when streaming without Content-Length; an uplink then treats the flow as large
(:data:`LARGE_RESPONSE` bytes). ``write`` must apply back-pressure (it awaits the writer's drain).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Protocol

__all__ = ["LARGE_RESPONSE", "TCP_NOTSENT_LOWAT", "Uplink", "UplinkFlow", "writer_socket"]

#: Remaining bytes assumed for a response of unknown length.
LARGE_RESPONSE = float(2**40)
#: ``setsockopt(IPPROTO_TCP, ...)`` option: unsent bytes the kernel keeps before poll() blocks.
TCP_NOTSENT_LOWAT: int = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


class UplinkFlow(Protocol):
    """One response on its way to one client."""

    async def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Uplink(Protocol):
    """A policy for the server's uplink: hands out one flow per response."""

    name: str

    def open(self, writer: asyncio.StreamWriter, total_bytes: int | None) -> UplinkFlow: ...


def writer_socket(writer: asyncio.StreamWriter) -> Any:
    """The socket under ``writer`` (``None`` when its transport has none)."""
    return writer.get_extra_info("socket")
