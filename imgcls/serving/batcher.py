"""Dynamic batching for an asyncio server: requests wait in a queue; the first one waiting opens a batch,
which closes when it holds `max_batch` items or `max_wait_s` after it opened, then runs on one model
thread while the next batch gathers. Only decoded images enter the queue, so a bad upload never reaches
a batch; an exception in a batch's run fails that batch's requests only.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

log = logging.getLogger("serve")


class DynamicBatcher:
    """`await submit(item)` -> that item's result from `run_batch(items) -> results` (same order, same
    length), called with up to `max_batch` items at a time on a single worker thread."""

    def __init__(self, run_batch: Callable[[list], list], max_batch: int, max_wait_s: float):
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.batches_run = 0
        self.items_run = 0
        self._queue: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, item: Any) -> Any:
        if self._queue is None:
            raise RuntimeError("the batcher is not running")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def stop(self) -> None:
        """Finish what is queued, then stop the loop and the model thread."""
        if self._task is not None:
            while self._queue is not None and not self._queue.empty():
                await asyncio.sleep(0.01)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def _gather(self) -> list:
        """One batch: wait for the first item, then up to `max_wait_s` for more, up to `max_batch`."""
        pending = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(pending) < self.max_batch:
            if not self._queue.empty():  # what queued during the last run: taken without waiting
                pending.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                pending.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return pending

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = await self._gather()
            live = [(item, future) for item, future in pending if not future.cancelled()]  # client gone
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [item for item, _ in live])
            except Exception as err:  # the model failed on this batch: its requests get a 500, the server goes on
                log.exception("a batch of %d failed", len(live))
                for _, future in live:
                    if not future.done():
                        future.set_exception(err)
                continue
            self.batches_run += 1
            self.items_run += len(live)
            for (_, future), result in zip(live, results):
                if not future.done():
                    future.set_result(result)
