"""Functions run in processes that torch.multiprocessing spawns for tests/test_distributed.py (kept apart
so that each spawned process imports only what it needs)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from imgcls.compute.device import DeviceInput
from imgcls.objectives.base import Objective
from imgcls.training.loop import measuring_parts, train_one_epoch
from imgcls.training.state import EpochCounters, TrainState
from imgcls.training.step import TrainStep


def nonfinite_on_one_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One epoch of 4 steps in a 2-process gloo group; rank 0's 2nd loss is infinite (its gradients finite)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
    calls = []

    def criterion(logits, targets):
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        return loss + float("inf") if rank == 0 and len(calls) == 2 else loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = TrainStep(model=torch.nn.parallel.DistributedDataParallel(model), objective=Objective(criterion),
                    optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    input=DeviceInput(torch.device("cpu"), [0.5] * 3, [0.5] * 3, False, None), accum_steps=1,
                    clip_grad_norm=None, nonfinite="skip", max_nonfinite_in_row=10, distributed=True)
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8, generator=g),
               torch.randint(0, 2, (4,), generator=g), torch.full((4,), -1)) for _ in range(4)]
    progress = EpochCounters()
    train_one_epoch(ctx, measuring_parts(log_interval=100), loader, 4, TrainState(), progress)
    torch.save({"skipped": progress.skipped_steps, "params": [p.detach() for p in model.parameters()]},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def thread_counts_agreed(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Each rank of a 2-process gloo group is told another thread count (OMP_NUM_THREADS 1 and 2); writes
    the count each settles on."""
    import os

    from imgcls.compute.device import Runtime
    from imgcls.config import load_config

    os.environ["OMP_NUM_THREADS"] = str(rank + 1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    runtime = Runtime(torch.device("cpu"), None)
    cfg = load_config("base", [])
    runtime.apply_cpu_policy(cfg.train.threads, cfg.train.reuse_host_memory, agree_over_ranks=True)
    threads, source = runtime.threads, runtime.threads_source
    torch.save({"threads": threads, "torch": torch.get_num_threads(), "source": source}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def calibrate_where_one_rank_cannot_see_best(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Each rank of a 2-process gloo group has its own run directory (as two nodes with separate working
    directories): only rank 0's holds best.pt. Both calibrate; a hang ends at the group's 60 s timeout."""
    from datetime import timedelta
    from pathlib import Path

    from imgcls.compute.distributed import DistInfo
    from imgcls.config import load_config
    from imgcls.models.factory import build_model
    from imgcls.training.calibrate import best_is_calibrated, calibrate_best

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cfg = load_config("base", ["model.name=test_resnet", "data.img_size=16", "train.batch_size=4"])
    torch.manual_seed(rank)  # the ranks' models differ until rank 0's best weights reach them
    model = build_model(cfg.model, 3)
    run_dir = Path(out_dir) / f"node{rank}"
    run_dir.mkdir()
    if rank == 0:
        torch.save({"model": model.state_dict()}, run_dir / "best.pt")
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=g), torch.tensor([0, 1, 2, rank]),
               torch.ones(4, dtype=torch.bool), torch.arange(4) + 4 * b + 8 * rank) for b in range(2)]
    device_input = DeviceInput(torch.device("cpu"), (0.5,) * 3, (0.25,) * 3, False, None)
    info = DistInfo(rank=rank, world_size=world)
    calibrated_before = best_is_calibrated(run_dir, info)
    record = calibrate_best(cfg, run_dir, model, loader, None, device_input, info)
    torch.save({"before": calibrated_before, "after": best_is_calibrated(run_dir, info), "record": record is not None,
                "weights": {k: v.clone() for k, v in model.state_dict().items()}}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()

