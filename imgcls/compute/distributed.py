"""What the launcher tells a process about its place in a multi-node job: torchelastic's restart count and
run id (torchrun), and the host it runs on. The only readers of these variables.

Process-group set-up for torchrun (env://), and the few collectives the engine needs.

Stop signals: the first SIGTERM / SIGINT / SIGUSR1 (Slurm's warning before the time limit) is remembered,
and the run saves last.pt and exits at the next optimizer step (143 / 130 / 138). Inside an `interruptible()` block (single-process validation) it raises StopRequested
at once instead, which also ends a read that blocks; under DDP validation asks at agreed batches."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from imgcls.core.errors import ConfigError, DistributedSetupError, StopRequested


@dataclass(frozen=True)
class LaunchInfo:
    restart_count: int = 0          # TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the worker group
    run_id: Optional[str] = None    # TORCHELASTIC_RUN_ID: torchrun's --rdzv-id (a fresh uuid with --standalone)

    @property
    def restarted(self) -> bool:
        return self.restart_count > 0


def launch_info(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """The launcher's record from `env`; outside torchrun a first start without a run id."""
    count = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return LaunchInfo(restart_count=int(count) if count.isdigit() else 0,
                      run_id=env.get("TORCHELASTIC_RUN_ID") or None)


@dataclass(frozen=True)
class ProcessPlace:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0


def whole_number(env: Mapping[str, str], name: str, default: int, lowest: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not text.lstrip("-").isdigit() or int(text) < lowest:
        raise ConfigError(f"{name}={raw!r}: the launcher environment needs a whole number >= {lowest} (torchrun "
                          f"sets it; unset {name} for one process)")
    return int(text)


def process_place(env: Mapping[str, str] = os.environ) -> ProcessPlace:
    """WORLD_SIZE, RANK and LOCAL_RANK as a launcher set them (one process when WORLD_SIZE is unset); a value
    that is no whole number, or out of range, is a ConfigError (exit 2) naming the variable."""
    world = whole_number(env, "WORLD_SIZE", 1, 1)
    rank = whole_number(env, "RANK", 0, 0)
    local_rank = whole_number(env, "LOCAL_RANK", 0, 0)
    if rank >= world:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world}: ranks run from 0 to {world - 1}")
    if world > 1 and not env.get("TORCHELASTIC_RUN_ID"):
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not (env.get(name) or "").strip():
                raise ConfigError(f"WORLD_SIZE={world} without {name}: name the address of rank 0's process "
                                  f"(MASTER_ADDR, MASTER_PORT), or start the run with torchrun")
    return ProcessPlace(world, rank, local_rank)


def host_name() -> str:
    return socket.gethostname()

log = logging.getLogger(__name__)


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    """The process count torchrun announces (1 outside torchrun); ConfigError (exit 2) naming a malformed variable."""
    return process_place().world_size


def env_local_rank() -> int:
    return process_place().local_rank


def env_rank() -> int:
    return process_place().rank


# How long a process started without torchrun waits for the others to join: torchrun's workers start once
# every node has joined, but a hand-set WORLD_SIZE with a missing peer would otherwise wait gloo's 30 minutes
JOIN_TIMEOUT = timedelta(minutes=5)


# Device types PyTorch's SyncBatchNorm runs on (DistributedDataParallel refuses it on CPU).
SYNC_BN_DEVICES = ("cuda", "xpu", "hpu")


def check_sync_bn(sync_bn: bool, device_type: str, world_size: int) -> None:
    """`model.sync_bn` under DDP needs accelerator processes; refuse it up front (exit 2) elsewhere."""
    if sync_bn and world_size > 1 and device_type not in SYNC_BN_DEVICES:
        raise ConfigError(f"'model.sync_bn' = true needs GPU processes: PyTorch's SyncBatchNorm does not run on "
                          f"{device_type}. Drop model.sync_bn, or use model.norm=group for small per-process batches")


def init_distributed(device_type: str, join_timeout: timedelta = JOIN_TIMEOUT) -> DistInfo:
    """Join the process group torchrun describes in the environment; a no-op for a single process. Started
    without torchrun, the processes wait at most `join_timeout` for each other (DistributedSetupError)."""
    world = env_world_size()
    if world <= 1:
        return DistInfo()
    rank = env_rank()
    local_rank = env_local_rank()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        store = restart_store(world, launch_info()) or joined_store(world, rank, join_timeout)
        if store is None:
            dist.init_process_group(backend=backend, init_method="env://")
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    except DistributedSetupError:
        raise
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DistributedSetupError(
            f"WORLD_SIZE={world} asks for distributed training, but the {backend} process group did not start "
            f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, "
            f"RANK={rank}): {reason}. Start the run with torchrun, or unset WORLD_SIZE for one process") from err
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world)


def restart_store(world: int, launch: LaunchInfo):
    """The process group's store for a worker group that torchrun restarted: the agent's store (the same
    server across restarts, so it still holds the keys the previous group published, among them its ranks'
    addresses, which a new rank may read before they are overwritten and then fail to connect; pytorch
    issue 167288), under a prefix of its own per restart. None for a first start (plain env://)."""
    if not launch.restarted or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=default_pg_timeout)
    return dist.PrefixStore(f"imgcls/restart_{launch.restart_count}", store)


def joined_store(world: int, rank: int, timeout: timedelta):
    """For processes started by hand (no torchrun agent): rank 0's store, waiting at most `timeout` until
    every process has joined. None under torchrun (its agent's store, whose workers start together)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"].strip()
    if not port.isdigit():
        return None  # env:// names the problem
    log.info("rank %d of %d: waiting up to %d s for the %s at %s:%s", rank, world, timeout.total_seconds(),
             f"other {world - 1} process(es)" if rank == 0 else "rank 0 process", address, port)
    try:
        store = dist.TCPStore(address, int(port), world, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    except Exception as err:
        waited = (f"the other {world - 1} process(es) to join {address}:{port}" if rank == 0
                  else f"rank 0 at {address}:{port}")
        raise DistributedSetupError(f"WORLD_SIZE={world}, RANK={rank}: waited {timeout.total_seconds():g} s for "
                                    f"{waited}; start every process (RANK 0 to {world - 1}), or run with torchrun "
                                    f"({type(err).__name__})") from err
    store.set_timeout(default_pg_timeout)
    return store


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def run_on_main(is_main: bool, fn, shared: tuple = (ConfigError,), share_result: bool = False):
    """`fn()` on rank 0 only. An error of a `shared` type that it raises is raised on every rank, as the same
    type (the others would wait for rank 0 at the next collective). Returns its result on rank 0, and on
    every rank with `share_result` (it must pickle)."""
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except shared as err:
            error = err
    if is_initialized():
        box = [None if error is None else (type(error), str(error)), result if share_result else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            kind, message = box[0]
            raise kind(f"rank 0: {message}")
        if share_result:
            result = box[1]
    if error is not None:
        raise error
    return result


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(tensor)
    return tensor


def union_of_lists(items: list) -> list:
    """The sorted union of every rank's list (e.g. indices of unreadable files); the same on all ranks."""
    if not is_initialized():
        return sorted(set(items))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(items))
    return sorted({item for part in gathered for item in part})


def all_gather_objects(item) -> list:
    """Every rank's `item` (it must pickle), in rank order; `[item]` in a single process."""
    if not is_initialized():
        return [item]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, item)
    return gathered


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (for stop requests)."""
    if not is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agreed_stop_check(received, batches: int, device: torch.device, every: int):
    """`should_stop(batches done)` for a pass whose ranks run different numbers of batches (`batches` here):
    every `every` batches, at counts every rank reaches, all ranks learn whether any got a stop signal
    (`received()`), so that all stop at the same batch."""
    reached_by_all = min_over_ranks(batches, device)
    return lambda done: done < reached_by_all and done % every == 0 and any_rank(received(), device)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (the same on all ranks)."""
    if not is_initialized():
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_ranks_true(flag: torch.Tensor) -> torch.Tensor:
    """A bool tensor that is true on every rank only if it is true on all of them (stays on the device)."""
    if not is_initialized():
        return flag
    agreed = flag.to(torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return agreed.bool()


def broadcast_buffers(*models: torch.nn.Module) -> None:
    """Copy BatchNorm running statistics (and other buffers) of `models` from rank 0 to all ranks.

    Each rank's BN statistics drift with its own last batches; after this every rank holds rank 0's,
    which are the ones rank 0 saves, so the model evaluated is the model saved."""
    if not is_initialized():
        return
    for model in models:
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)


def broadcast_state(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers into `model` on every rank (what rank 0 loaded from a file the others
    may not see)."""
    if not is_initialized():
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, 0)


def convert_sync_bn(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """Replace every BatchNorm layer by SyncBatchNorm (statistics over the global batch); returns the
    model and how many layers were converted."""
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model, sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


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
            return step % STEP_STOP_EVERY == 0 and any_rank(self.received, device)
        return self.received

    def validation_guard(self, dist, num_batches: Optional[int], device):
        """(context, should_stop) for a validation pass: in one process a stop signal ends it at once, also out
        of a read that blocks; under DDP the ranks agree every VAL_STOP_EVERY batches (a shard stream, with no
        length, only after the pass)."""
        if dist.enabled:
            return contextlib.nullcontext(), agreed_stop_check(lambda: self.received, num_batches or 0,
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
