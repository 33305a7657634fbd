"""The engine server's hand-over of streamed outputs from the engine thread to the event loop: every output reaches
its request's queue in order, and outputs posted while the loop is busy share one wake-up (not one per token)."""

from __future__ import annotations

import asyncio
import threading

from gyre_cell.engine.server import _LoopMailbox


def test_outputs_posted_while_the_loop_is_busy_arrive_in_order_with_one_wake_up():
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        real = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wake_ups
            wake_ups += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box = _LoopMailbox(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(3)]

        def engine_thread() -> None:  # one step's token for each request, 50 steps
            for step in range(50):
                for q in queues:
                    box.post(q, step)

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()  # the loop is blocked meanwhile: the gate that makes every post wait for one delivery
        got = [[await q.get() for _ in range(50)] for q in queues]
        return got, wake_ups

    got, wake_ups = asyncio.run(main())
    assert got == [list(range(50))] * 3
    assert wake_ups == 1


def test_a_post_after_a_delivery_wakes_the_loop_again():
    async def main() -> list[int]:
        box = _LoopMailbox(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        out = []
        for i in range(3):
            threading.Thread(target=box.post, args=(q, i)).start()
            out.append(await asyncio.wait_for(q.get(), 10))
        return out

    assert asyncio.run(main()) == [0, 1, 2]
