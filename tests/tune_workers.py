"""The LR range test in a process that torch.multiprocessing spawns for tests/test_tune.py (2-process gloo)."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def lr_range_on_rank(rank: int, world: int, init_file: str, overrides: list, out_dir: str) -> None:
    from imgcls.compute.device import Runtime, select_device
    from imgcls.compute.distributed import DistInfo
    from imgcls.config import load_config
    from imgcls.training.arithmetic import lr_suggestion
    from imgcls.tuning.sweep import run_lr_range

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = load_config("base", overrides)
    ctx = Runtime(select_device("cpu"), None, DistInfo(rank=rank, local_rank=rank, world_size=world))
    result = run_lr_range(cfg, ctx, 1e-3, 10.0, 6)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"lrs": result.lrs, "losses": result.losses, **lr_suggestion(result.lrs, result.smoothed)}, f)
    dist.destroy_process_group()
