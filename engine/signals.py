"""Stop signals: the first SIGTERM / SIGINT is remembered, and the run saves last.pt and exits at the
next optimizer step (or at the end of the validation pass it is in)."""
from __future__ import annotations

import logging
import signal
from typing import Optional

log = logging.getLogger("train")

EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGINT: 130}


class StopSignal:
    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

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

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("received %s: saving last.pt at the end of this step, then stopping",
                        signal.Signals(signum).name)
