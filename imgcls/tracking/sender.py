"""The background sender: records go into a bounded queue and one thread sends them, so the job never waits
on the tracking store. A record that fails is retried a few times; then it goes to the backlog, the store
counts as down for a while (records meanwhile go straight to the backlog), and a warning says so at most
once a minute. A run that could not be created at all sends nothing more: its records all go to the backlog,
which creates the run on replay."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from imgcls.core.redaction import redact_text
from imgcls.tracking.backlog import Backlog

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000           # records waiting; beyond it the caller writes them to the backlog itself
ATTEMPTS = 3                  # tries per record before it goes to the backlog
RETRY_WAIT_S = 0.5            # before the second try; doubled for each next one
DOWN_FOR_S = 30.0             # after a record failed every try, the store is not tried again for this long
WARN_EVERY_S = 60.0
# at the end, the start record may take this long: creating a new SQLite store runs MLflow's schema migrations,
# a minute on a loaded machine, and a store left half-migrated cannot be opened again
START_CALL_S = 180.0
_STOP = object()


class RateLimitedWarning:
    """log.warning at most once per `every_s` seconds; the ones held back are counted in the next."""

    def __init__(self, every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last: Optional[float] = None
        self.held = 0

    def warn(self, message: str) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            self.held += 1
            return False
        more = f" ({self.held} more such warning(s) held back)" if self.held else ""
        log.warning("tracking: %s%s", message, more)
        self.last, self.held = now, 0
        return True


class Sender:
    """`submit` never blocks. `store` has `apply(record)` and `run_id`; `close(timeout_s)` sends what is queued
    (what is still unsent after the timeout goes to the backlog) and ends the thread."""

    def __init__(self, store, backlog: Backlog, queue_size: int = QUEUE_SIZE, attempts: int = ATTEMPTS,
                 retry_wait_s: float = RETRY_WAIT_S, down_for_s: float = DOWN_FOR_S,
                 on_started: Optional[Callable[[str], None]] = None):
        """`on_started(run_id)`: called on the sender thread once the store created or opened the run."""
        self.store, self.backlog = store, backlog
        self.on_started = on_started
        # the run the start record names (--resume: last.pt's): the records written to the backlog while the
        # store cannot confirm it still name it, so that a replay puts them there
        self.run_id_named: Optional[str] = None
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.attempts, self.retry_wait_s, self.down_for_s = attempts, retry_wait_s, down_for_s
        self.warning = RateLimitedWarning()
        self.down_until = 0.0
        self.run_missing = False        # the start record failed: nothing is sent, all goes to the backlog
        self.closing = threading.Event()
        self.in_flight: Optional[dict] = None
        self.progress_at = time.monotonic()  # when the thread last finished a record
        self.started = threading.Event()  # the start record was handled (the run exists, or it failed)
        self.thread = threading.Thread(target=self._work, name="tracking-sender", daemon=True)
        self.thread.start()

    def submit(self, record: dict) -> None:
        if record.get("op") == "start":
            self.run_id_named = record.get("run_id")
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.backlog.append([self._addressed(record)])
            self.warning.warn(f"the tracking store is slower than the job: records go to {self.backlog.path}")

    def _addressed(self, record: dict) -> dict:
        return record if record.get("op") == "start" else {**record, "run_id": self.store.run_id or self.run_id_named}

    def _work(self) -> None:
        while True:
            record = self.queue.get()
            if record is _STOP:
                return
            self.in_flight = record
            self._send(record)
            self.in_flight = None
            self.progress_at = time.monotonic()
            if record.get("op") == "start":
                self._started()

    def _started(self) -> None:
        if self.store.run_id and self.on_started is not None:
            try:
                self.on_started(self.store.run_id)
            except OSError as err:  # a full disk: the run id is still in last.pt
                log.warning("tracking: could not record run %s in the run directory: %s", self.store.run_id, err)
        self.started.set()

    def _send(self, record: dict) -> None:
        if self.run_missing or time.monotonic() < self.down_until:
            self.backlog.append([self._addressed(record)])
            return
        error = None
        for attempt in range(self.attempts):
            try:
                self.store.apply(record)
                return
            except Exception as err:  # whatever the store raises: the job goes on
                error = err
                if attempt + 1 < self.attempts and self.closing.wait(self.retry_wait_s * 2 ** attempt):
                    break
        self.down_until = time.monotonic() + self.down_for_s
        if record.get("op") == "start" and self.store.run_id is None:
            self.run_missing = True
        self.backlog.append([self._addressed(record)])
        reason = redact_text((str(error).strip().splitlines() or [type(error).__name__])[0])[:300]
        self.warning.warn(f"could not reach the tracking store ({type(error).__name__}: {reason}); the run "
                          f"goes on, and what is not logged goes to {self.backlog.path} (send it later with "
                          f"python -m imgcls.tracking.replay {self.backlog.path.parent})")

    def close(self, timeout_s: float) -> None:
        """Send what is queued while the store keeps answering: the wait ends when no record was finished for
        `timeout_s` (START_CALL_S while the run is being created); the rest goes to the backlog."""
        try:
            self.queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        while self.thread.is_alive():
            limit = START_CALL_S if (self.in_flight or {}).get("op") == "start" else timeout_s
            if time.monotonic() - self.progress_at > limit:
                break
            self.thread.join(0.2)
        if self.thread.is_alive():  # the store hangs: what is left is written out, the daemon thread abandoned
            self.closing.set()
            left = [r for r in [self.in_flight, *drain(self.queue)] if r is not None and r is not _STOP]
            self.backlog.append([self._addressed(r) for r in left])
            log.warning("tracking: the store stopped answering at the end (nothing sent for %.0f s); %d "
                        "record(s) written to %s", timeout_s, len(left), self.backlog.path)


def drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
