"""Stop signals: the first SIGTERM / SIGINT is remembered, and the run saves last.pt and exits at the
next optimizer step. Inside an `interruptible()` block (single-process validation) it raises StopRequested
at once instead, which also ends a read that blocks; under DDP validation asks at agreed batches."""
from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from typing import Optional

from core.errors import StopRequested

log = logging.getLogger("train")

EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGINT: 130}


class StopSignal:
    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._interruptible = False

    @property
    def received(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before `install` (matters when fit() runs in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def exit_status(self) -> int:
        return EXIT_SIGNAL.get(self.signum or signal.SIGTERM, 143)

    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    @contextmanager
    def interruptible(self):
        """Within the block a stop signal (or one received before it) raises StopRequested at once."""
        if self.received:
            raise StopRequested()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self._interruptible:
                self._interruptible = False
                log.warning("received %s: stopping the validation pass, saving last.pt, then stopping",
                            signal.Signals(signum).name)
                raise StopRequested()
            log.warning("received %s: saving last.pt at the end of this step, then stopping",
                        signal.Signals(signum).name)
