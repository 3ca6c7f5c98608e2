"""A response on its way to a slow client: memory first, then an unlinked temporary file.

Apache's answer is read at Apache's pace and written at the client's (nginx's proxy buffering
with temp files, HAProxy's buffers): the stage slot is released when Apache has sent everything,
not when the client has read it, so a slow reader never holds a thread of the policy's. The
first ``memory_bytes`` stay in memory; the rest goes to a temporary file that is unlinked at
creation (nothing is left on disk, whatever happens to the process). The writer is held back
(:meth:`Spool.wait_room`) once more than a cap of bytes wait on disk.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import deque
from typing import IO

__all__ = ["Spool"]

_READ = 1 << 16  # bytes per read from the file: one socket write's worth


class Spool:
    """Bytes in order, appended by one producer and read by one consumer."""

    def __init__(self, memory_bytes: int, directory: str | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.directory = directory
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

    async def wait_room(self, disk_cap: int) -> None:
        """Return once at most ``disk_cap`` bytes wait on disk (or the spool is closed)."""
        while self.disk_bytes > disk_cap and not self._closed:
            self._room.clear()
            await self._room.wait()

    def close(self) -> None:
        """Drop what is left and release the file; wakes both sides."""
        self._closed = True
        self._mem.clear()
        self._mem_bytes = 0
        if self._file is not None:
            self._file.close()
            self._file = None
        self._rpos = self._wpos = 0
        self._data.set()
        self._room.set()
