"""The CPU tuning lives in one room (imgcls/compute/cpu_tuning.py): chosen once at process start by
run_main, applied once at runtime set-up, and passed through no signature."""
from __future__ import annotations

import ast

import pytest
import torch
from conftest import REPO, source_files

import imgcls.compute.cpu_tuning as cpu_tuning
from imgcls.config import load_config

# parameters named `host` that are a network host, not the CPU tuning
NETWORK_HOSTS = {("imgcls/serving/server.py", "serve"), ("imgcls/serving/slim.py", "serve_onnx"),
                 ("imgcls/models/factory.py", "can_connect")}


def test_no_function_takes_the_cpu_tuning_as_a_parameter():
    carriers = []
    for path in source_files(tests=False):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if any(name in ("host", "omp_choice") for name in names) and (rel, node.name) not in NETWORK_HOSTS:
                    carriers.append(f"{rel}:{node.lineno} {node.name}")
    assert carriers == []


def test_run_main_tunes_the_process_once_and_calls_main_bare():
    from imgcls.cli import run_main

    seen = []
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: seen.append(cpu_tuning.process_start()) or 0)
    assert exit_info.value.code == 0
    assert seen[0] is not None and seen[0].reason                       # chosen before main ran
    assert cpu_tuning.omp_wait_description() == seen[0].reason


def test_freed_memory_is_kept_for_training_only(monkeypatch):
    from imgcls.compute.device import build_runtime

    kept = []
    monkeypatch.setattr(cpu_tuning, "keep_freed_memory", lambda: kept.append(True) or True)
    cfg = load_config("base", ["train.device=cpu", "train.threads=1", "train.amp=none"])
    before = torch.get_num_threads()
    try:
        predicting = build_runtime(cfg, training=False)
        assert kept == [] and predicting.threads_source.endswith("malloc's defaults")
        training = build_runtime(cfg)
        assert kept == [True] and training.threads_source.endswith("freed memory kept for reuse")
        cfg.train.reuse_host_memory = False
        assert build_runtime(cfg).threads_source.endswith("malloc's defaults") and kept == [True]
    finally:
        torch.set_num_threads(before)
