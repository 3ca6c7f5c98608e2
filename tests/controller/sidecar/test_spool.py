"""The spool's shared disk budget: its count is always the bytes on disk of every spool, and a
producer held back beyond it is released by another spool's reader."""

from __future__ import annotations

import asyncio

from overtake.controller.sidecar.budget import ByteBudget
from overtake.controller.sidecar.spool import Spool


def test_the_budget_counts_the_bytes_on_disk_and_releases_a_waiting_producer() -> None:
    async def go() -> None:
        budget = ByteBudget(100)
        a, b = Spool(10, budget=budget), Spool(10, budget=budget)

        def on_disk() -> int:
            return a.disk_bytes + b.disk_bytes

        a.append(b"a" * 50)  # larger than memory: on disk
        b.append(b"b" * 80)
        assert budget.used == on_disk() == 130 and budget.over
        waiting = asyncio.create_task(b.wait_room(1 << 30))  # within its own cap, over the shared one
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert await a.read() == b"a" * 50  # another spool's client reads: room for b
        await asyncio.wait_for(waiting, 1)
        assert budget.used == on_disk() == 80 and not budget.over
        await b.wait_room(1 << 30)  # within the budget: no wait
        b.append(b"c" * 30)
        assert budget.used == on_disk() == 110
        b.close()  # a client gone: its bytes on disk are given back
        assert budget.used == on_disk() == 0
        a.append(b"d" * 20)
        a.feed_eof()
        assert await a.read() == b"d" * 20 and await a.read() == b""
        assert budget.used == 0
        a.close()  # the drain's end: the temporary file is released

    asyncio.run(go())
