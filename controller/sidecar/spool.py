"""A response on its way to a slow client: memory first, then an unlinked temporary file.

Apache's answer is read at Apache's pace and written at the client's (nginx's proxy buffering
with temp files, HAProxy's buffers): the stage slot is released when Apache has sent everything,
not when the client has read it, so a slow reader never holds a thread of the policy's. The
first ``memory_bytes`` stay in memory; the rest goes to a temporary file that is unlinked at
creation (nothing is left on disk, whatever happens to the process). The writer is held back
(:meth:`Spool.wait_room`) once more than a cap of bytes wait on disk, or, while all spools
together hold more than their shared :class:`~overtake.controller.sidecar.budget.ByteBudget`, until its
own bytes on disk have been read: beyond the budget an answer moves at its client's pace.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import deque
from typing import IO

from overtake.controller.sidecar.budget import ByteBudget

__all__ = ["Spool"]

_READ = 1 << 16  # bytes per read from the file: one socket write's worth


class Spool:
    """Bytes in order, appended by one producer and read by one consumer."""

    def __init__(self, memory_bytes: int, directory: str | None = None, budget: ByteBudget | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.directory = directory
        self.budget = budget  #: bytes on disk of every spool
        self._mem: deque[bytes] = deque()
        self._mem_bytes = 0
        self._file: IO[bytes] | None = None
        self._wpos = 0  # file offsets: written up to, read up to
        self._rpos = 0
        self._eof = False
        self._closed = False
        self._data = asyncio.Event()  # set: something to read (or EOF, or closed)
        self._room = asyncio.Event()  # set: the consumer took something (or closed)

    @property
    def disk_bytes(self) -> int:
        """Bytes waiting in the file."""
        return self._wpos - self._rpos

    @property
    def pending_bytes(self) -> int:
        """Bytes appended and not yet read."""
        return self._mem_bytes + self.disk_bytes

    def append(self, data: bytes) -> None:
        """Queue ``data`` (in memory while the file is empty and memory has room, else on disk)."""
        if not data or self._closed:
            return
        if self.disk_bytes == 0 and self._mem_bytes + len(data) <= self.memory_bytes:
            self._mem.append(data)
            self._mem_bytes += len(data)
        else:
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=self.directory)  # unlinked: never left behind
            self._file.seek(self._wpos)
            self._file.write(data)
            self._wpos += len(data)
            if self.budget is not None:
                self.budget.add(len(data))
        self._data.set()

    def feed_eof(self) -> None:
        """Nothing more will be appended."""
        self._eof = True
        self._data.set()

    async def read(self) -> bytes:
        """The next bytes in order; ``b""`` once everything was read after :meth:`feed_eof`."""
        while True:
            if self._mem:
                chunk = self._mem.popleft()
                self._mem_bytes -= len(chunk)
                self._room.set()
                return chunk
            if self._file is not None and self._rpos < self._wpos:
                self._file.seek(self._rpos)
                chunk = self._file.read(min(_READ, self._wpos - self._rpos))
                self._rpos += len(chunk)
                if self.budget is not None:
                    self.budget.give(len(chunk))
                if self._rpos == self._wpos:  # drained: reuse the file from its start
                    self._file.seek(0)
                    self._file.truncate()
                    self._rpos = self._wpos = 0
                self._room.set()
                return chunk
            if self._eof or self._closed:
                return b""
            self._data.clear()
            await self._data.wait()

    def _full(self, disk_cap: int) -> bool:
        over = self.budget is not None and self.budget.over and self.disk_bytes > 0
        return not self._closed and (self.disk_bytes > disk_cap or over)

    async def wait_room(self, disk_cap: int) -> None:
        """Return once at most ``disk_cap`` bytes wait on disk and, while the shared budget is
        exceeded, none (or the spool is closed)."""
        if not self._full(disk_cap):
            return
        if self.budget is not None:
            self.budget.watch(self._room)  # another spool's reader may make the room
        try:
            while self._full(disk_cap):
                self._room.clear()
                await self._room.wait()
        finally:
            if self.budget is not None:
                self.budget.unwatch(self._room)

    def close(self) -> None:
        """Drop what is left and release the file; wakes both sides."""
        self._closed = True
        if self.budget is not None:
            self.budget.give(self.disk_bytes)
        self._mem.clear()
        self._mem_bytes = 0
        if self._file is not None:
            self._file.close()
            self._file = None
        self._rpos = self._wpos = 0
        self._data.set()
        self._room.set()
