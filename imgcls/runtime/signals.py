"""Stop signals: the first SIGTERM / SIGINT / SIGUSR1 (Slurm's warning before the time limit) is remembered,
and the run saves last.pt and exits at the next optimizer step (143 / 130 / 138). Inside an `interruptible()` block (single-process validation) it raises StopRequested
at once instead, which also ends a read that blocks; under DDP validation asks at agreed batches."""
from __future__ import annotations

import logging
import signal
import contextlib
from contextlib import contextmanager
from typing import Optional

from imgcls.core.errors import StopRequested
import imgcls.runtime.distributed as dist_utils

log = logging.getLogger(__name__)

STEP_STOP_EVERY = 10  # under DDP, optimizer steps between the ranks' agreements on a stop signal
VAL_STOP_EVERY = 10   # under DDP, validation batches between them
EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGUSR1: 138}
STOP_SIGNALS = tuple(EXIT_SIGNAL)


class StopSignal:
    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._interruptible = False

    @property
    def received(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
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

    def agreed(self, step: int, dist, device) -> bool:
        """Whether to stop after optimizer step `step`. Under DDP all ranks must agree on the step they stop
        at; asking every STEP_STOP_EVERY steps bounds the host syncs."""
        if dist.enabled:
            return step % STEP_STOP_EVERY == 0 and dist_utils.any_rank(self.received, device)
        return self.received

    def validation_guard(self, dist, num_batches: Optional[int], device):
        """(context, should_stop) for a validation pass: in one process a stop signal ends it at once, also out
        of a read that blocks; under DDP the ranks agree every VAL_STOP_EVERY batches (a shard stream, with no
        length, only after the pass)."""
        if dist.enabled:
            return contextlib.nullcontext(), dist_utils.agreed_stop_check(lambda: self.received, num_batches or 0,
                                                                          device, VAL_STOP_EVERY)
        return self.interruptible(), None

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
