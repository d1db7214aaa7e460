"""The data side of the training recipes: auto-augment policies on the uint8 crop, repeated augmentation,
evaluation at another size than training (FixRes), their usage errors, and exact resume with them on."""
from __future__ import annotations

import json
import signal
from collections import Counter

import pytest
import torch
from conftest import make_tree, run_train_in_process, tiny_overrides
from kill_and_resume import STEPS_PER_EPOCH, assert_same_result, kill_at_pause, paused, run_to_end, start, train_cmd
from torchvision.transforms import InterpolationMode

from imgcls.commands.evaluate import evaluate_checkpoint
from imgcls.config import Config, ConfigError, config_differences, load_config
from imgcls.data.build import build_run_data, describe_augmentation, eval_transform, train_transform
from imgcls.data.datasets import TrainDataset
from imgcls.data.listing import scan_split
from imgcls.data.loaders import TrainSampler
from imgcls.data.transforms import EvalTransform, auto_augment_policy, normalize_batch
from imgcls.model_files.checkpoint_files import build_eval_model, read_checkpoint
from imgcls.training.trainer import run

POLICIES = ["randaugment", "trivialaugment", "autoaugment", "augmix"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """3 classes, 4 train / 2 val images each, 40x30 (not square: the crop has work to do)."""
    return make_tree(tmp_path_factory.mktemp("recipe") / "data", {"a": (4, 2), "b": (4, 2), "c": (4, 2)},
                     size=(40, 30))


def train_dataset(root, **data):
    cfg = load_config(None, tiny_overrides(root, root / "unused", **{f"data.{k}": v for k, v in data.items()}))
    return TrainDataset(scan_split(root / "train"), train_transform(cfg.data))


# ---------------------------------------------------------------- auto-augment policies


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_gives_img_size_uint8_crops_that_are_a_function_of_the_sample_seed(photos, policy):
    plain = train_dataset(photos)
    augmented = train_dataset(photos, auto_augment=policy)
    changed = 0
    for seed in range(8):
        torch.manual_seed(seed)                                          # whatever the process's RNG holds,
        image, label, bad = augmented[(seed % 12, seed)]
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16) and bad == -1
        torch.manual_seed(1000 + seed)
        outside = torch.get_rng_state()
        assert torch.equal(image, augmented[(seed % 12, seed)][0])        # same sample seed, same pixels
        assert torch.equal(torch.get_rng_state(), outside), "the policy must draw from the per-sample seed only"
        changed += not torch.equal(image, plain[(seed % 12, seed)][0])   # same crop and flip, then the policy
    assert changed >= 4, f"{policy} left {8 - changed} of 8 crops untouched"
    assert not torch.equal(augmented[(0, 1)][0], augmented[(0, 2)][0])   # another seed, another draw


def test_magnitude_ops_and_interpolation_reach_the_torchvision_policies():
    rand = auto_augment_policy("randaugment", 5, 3, "nearest")
    assert (rand.magnitude, rand.num_ops, rand.interpolation) == (5, 3, InterpolationMode.NEAREST)
    # torchvision's tensor affine ops take no bicubic: a bicubic run's policy uses bilinear, and runs
    bicubic = auto_augment_policy("randaugment", 30, 2, "bicubic")
    assert bicubic.interpolation == InterpolationMode.BILINEAR
    torch.manual_seed(0)
    for _ in range(20):
        assert bicubic(torch.zeros(3, 16, 16, dtype=torch.uint8)).shape == (3, 16, 16)
    assert auto_augment_policy("augmix", 30, 2, "bilinear").severity == 10   # clipped to AugMix's 1..10
    assert auto_augment_policy("augmix", 0, 2, "bilinear").severity == 1
    assert auto_augment_policy("augmix", 4, 2, "bilinear").severity == 4
    assert auto_augment_policy("autoaugment", 9, 2, "bilinear").policy.value == "imagenet"
    assert auto_augment_policy(None, 9, 2, "bilinear") is None
    with pytest.raises(ConfigError, match="data.auto_augment_magnitude"):
        load_config(None, ["data.auto_augment_magnitude=31"])
    with pytest.raises(ConfigError, match="'data.auto_augment'"):
        load_config(None, ["data.auto_augment=randaug"])


def test_the_torchvision_loader_baseline_applies_the_same_policy(photos):
    from torchvision.transforms import v2

    from imgcls.benchmarking.modes import torchvision_train_loader

    cfg = load_config(None, tiny_overrides(photos, photos / "unused", **{"data.auto_augment": "trivialaugment"}))
    steps = torchvision_train_loader(cfg, 4, False).dataset.transform.transforms
    assert [type(t) for t in steps].count(v2.TrivialAugmentWide) == 1
    cfg.data.auto_augment = None
    assert not any(isinstance(t, v2.TrivialAugmentWide) for t in torchvision_train_loader(cfg, 4, False)
                   .dataset.transform.transforms)


# ---------------------------------------------------------------- repeated augmentation


def epoch_shares(n: int, repeats: int, world: int, epoch: int = 0, seed: int = 0, batch: int = 4):
    out = []
    for rank in range(world):
        sampler = TrainSampler([0] * n, "random", seed, batch, rank, world, repeats=repeats)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("n, repeats, world", [(48, 3, 1), (48, 3, 3), (50, 4, 2), (50, 2, 4)])
def test_repeated_augment_takes_each_image_k_times_in_an_epoch_of_the_split_length(n, repeats, world):
    shares = epoch_shares(n, repeats, world, epoch=2)
    per_rank = -(-n // world)
    assert [len(s) for s in shares] == [per_rank] * world               # the usual epoch length per rank
    counts = Counter(i for share in shares for i, _ in share)
    full = [c for c in counts.values() if c == repeats]
    assert len(full) == per_rank * world // repeats                     # all but the cut-off last image, k times
    assert sum(counts.values()) == per_rank * world and max(counts.values()) == repeats
    seeds = [s for share in shares for _, s in share]
    assert len(set(seeds)) == len(seeds)                                # every copy gets its own augmentation
    if world >= repeats:  # the copies of one image land on different ranks, as in RASampler
        for share in shares:
            assert len({i for i, _ in share}) == len(share)
    assert shares == epoch_shares(n, repeats, world, epoch=2)            # a function of (seed, epoch)
    assert shares != epoch_shares(n, repeats, world, epoch=3)


def test_repeated_augment_changes_the_image_set_by_epoch_and_resumes_at_any_batch():
    first = {i for i, _ in epoch_shares(60, 3, 1, epoch=0)[0]}
    second = {i for i, _ in epoch_shares(60, 3, 1, epoch=1)[0]}
    assert len(first) == len(second) == 20 and first != second
    sampler = TrainSampler([0] * 60, "random", 5, 4, 1, 2, repeats=3)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, start_batch=3)
    assert list(sampler) == full[12:] and len(sampler) == len(full) - 12


def test_repeated_augment_through_the_loader(photos):
    cfg = load_config(None, tiny_overrides(photos, photos / "unused", **{"data.repeated_augment": 4,
                                                                         "train.batch_size": 4}))
    data = build_run_data(cfg, 4, 0, 1, False)
    data.sampler.set_epoch(0)
    batches = list(data.train_loader)
    assert len(batches) == 3                                             # 12 images, batch 4: unchanged
    for images, labels, _ in batches:                                    # one image 4 times, 4 crops of it
        assert len(set(labels.tolist())) == 1
        assert len({bytes(im.numpy()) for im in images}) == 4


@pytest.mark.slow
def test_weighted_or_sequential_sampler_with_repeated_augment_exits_2_naming_both_keys(monkeypatch, capsys,
                                                                                      tmp_path):
    for sampler in ("weighted", "sequential"):
        code, err = run_train_in_process(monkeypatch, capsys, "--config", "quickstart", f"data.sampler={sampler}",
                                         "data.repeated_augment=2", f"output.dir={tmp_path / 'run'}")
        assert code == 2 and "'data.repeated_augment'" in err and "'data.sampler'" in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="'data.repeated_augment'"):
        load_config(None, ["data.repeated_augment=0"])


# ---------------------------------------------------------------- evaluation at another size (FixRes)


def test_eval_img_size_sets_the_eval_transform_and_the_start_up_lines(photos):
    cfg = load_config(None, tiny_overrides(photos, photos / "unused", **{"data.eval_img_size": 24,
                                                                         "data.crop_pct": 0.75}))
    transform = eval_transform(cfg.data)
    assert (transform.img_size, transform.resize_to) == (24, 32)
    assert transform(scan_split(photos / "val").paths[0]).shape == (3, 24, 24)
    assert train_dataset(photos, eval_img_size=24)[(0, 0)][0].shape == (3, 16, 16)   # training keeps img_size
    assert describe_augmentation(cfg.data) == ["training at 16 px, evaluating at 24 px (resize 32, centre crop)"]
    assert eval_transform(load_config(None, tiny_overrides(photos, photos / "x")).data).img_size == 16


@pytest.mark.slow
def test_validation_checkpoint_and_eval_use_eval_img_size(photos, tmp_path):
    """A resnet10t trained at 16 px, validated at 24 (its global pooling takes any size): best.pt records the
    eval size, eval.py reproduces validation exactly from it (an override still changes the size), and
    infer.py classifies at that size."""
    run_dir = tmp_path / "run"
    cfg = load_config("base", tiny_overrides(photos, run_dir, **{"data.eval_img_size": 24, "train.batch_size": 4,
                                                                 "train.epochs": 1, "output.tensorboard": False}))
    assert run(cfg) == 0
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["preprocessing"]["img_size"] == 24 and best["preprocessing"]["train_img_size"] == 16
    assert best["preprocessing"]["resize"] == 27                        # floor(24 / 0.875)
    loaded = read_checkpoint(run_dir / "best.pt")
    assert (loaded.eval_transform().img_size, loaded.cfg.data.eval_img_size) == (24, None)
    summary = json.loads((run_dir / "summary.json").read_text())
    result = evaluate_checkpoint(run_dir / "best.pt")
    assert result.settings["preprocessing"]["img_size"] == 24 and result.settings["preprocessing"]["resize"] == 27
    assert {k: result.metrics[k] for k in summary["best"]} == summary["best"]    # bit for bit, loss included
    other = evaluate_checkpoint(run_dir / "best.pt", overrides=["data.img_size=32"])
    assert other.settings["preprocessing"]["img_size"] == 32 and other.metrics["num_samples"] == 6
    assert other.metrics["loss"] != summary["best"]["loss"]

    import infer  # infer.py classifies at 24 px too
    out = tmp_path / "pred.json"
    assert infer.main([str(photos / "val"), "--checkpoint", str(run_dir / "best.pt"), "--batch-size", "4",
                       "--output", str(out), "--num-workers", "0"]) == 0
    rows = json.loads(out.read_text())
    model = build_eval_model(loaded, torch.device("cpu"), channels_last=False)

    def top_probs(size: int) -> torch.Tensor:
        transform = EvalTransform(size, 0.875, "bilinear")
        images = normalize_batch(torch.stack([transform(r["path"]) for r in rows]), cfg.data.mean, cfg.data.std)
        temperature = (loaded.calibration or {}).get("temperature") or 1.0  # infer.py's prob is calibrated
        with torch.no_grad():
            return (model(images) / temperature).softmax(1).max(1).values

    infer_probs = torch.tensor([r["prob"] for r in rows])
    assert torch.allclose(infer_probs, top_probs(24), atol=1e-4)        # BatchNorm folding: float rounding only
    assert not torch.allclose(infer_probs, top_probs(16), atol=1e-3)


# ---------------------------------------------------------------- exact resume with the policies on


def test_a_checkpoint_from_before_the_recipe_keys_resumes_with_their_defaults():
    saved = Config().to_dict()
    for key in ("auto_augment", "auto_augment_magnitude", "auto_augment_ops", "repeated_augment", "eval_img_size"):
        del saved["data"][key]
    assert config_differences(saved, Config().to_dict()) == []
    changed = load_config(None, ["data.auto_augment=randaugment", "data.repeated_augment=2"]).to_dict()
    assert config_differences(saved, changed) == ["data.auto_augment: None -> 'randaugment'",
                                                  "data.repeated_augment: 1 -> 2"]


@pytest.mark.slow
def test_sigkill_and_resume_with_randaugment_and_repeats_is_bitwise_equal(tmp_path):
    """tests/faults/test_resume.py's kill-and-resume, with RandAugment and repeated augmentation on: killed in epoch 2
    with two loader workers, resumed with none, bitwise equal to the uninterrupted run."""
    data = make_tree(tmp_path / "data", {"a": (12, 4), "b": (12, 4), "c": (12, 4)})
    recipe = ["data.auto_augment=randaugment", "data.repeated_augment=2", "data.auto_augment_magnitude=12"]
    reference = tmp_path / "reference"
    run_to_end(train_cmd(data, reference, *recipe))
    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = start(train_cmd(data, run, *recipe, script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    kill_at_pause(proc, marker)
    assert proc.returncode == -signal.SIGKILL
    done = run_to_end(train_cmd(data, run, "--resume", "auto", *recipe, "data.num_workers=0"))
    assert "resumed at epoch 2, batch 1" in done.stderr and "auto-augment: randaugment" in done.stderr
    assert_same_result(run, reference)
