"""Distillation (objectives/distillation): the loss terms against hand computations, the teacher's input conversion,
the teacher frozen and outside every state_dict, the class check; and whole runs (marked slow): the teacher
validated and the agreement recorded, last.pt / best.pt without the teacher, another teacher or class list
refused (exit 2)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_tree, run_script, tiny_overrides

from imgcls.config import load_config
from imgcls.objectives.distillation import (AgreementProbe, Distiller, InputConversion, feature_distance, hard_bce,
                                            hard_ce, soft_bce, soft_kl)
from imgcls.objectives.teacher import Teacher, TeacherPredictions, class_mismatch, freeze
from imgcls.tasks import get_task

S = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
T = torch.tensor([[1.0, 3.0, 0.0], [-0.5, 0.0, 2.5]])


def softmax_list(row, t):
    e = [math.exp(v / t) for v in row]
    return [v / sum(e) for v in e]


def test_soft_kl_is_the_tempered_kl_times_t_squared():
    temperature = 4.0
    expected = 0.0
    for s, t in zip(S.tolist(), T.tolist()):
        p, q = softmax_list(t, temperature), softmax_list(s, temperature)
        expected += sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
    expected = expected / len(S) * temperature ** 2
    assert soft_kl(S, T, temperature).item() == pytest.approx(expected, rel=1e-6)
    assert soft_kl(T, T, temperature).item() == pytest.approx(0.0, abs=1e-7)


def test_hard_ce_is_cross_entropy_on_the_teachers_top_class():
    # the teacher's top classes are 1 and 2
    expected = -(math.log(softmax_list(S[0].tolist(), 1)[1]) + math.log(softmax_list(S[1].tolist(), 1)[2])) / 2
    assert hard_ce(S, T).item() == pytest.approx(expected, rel=1e-6)


def test_multilabel_terms_are_bce_against_the_teachers_sigmoids():
    temperature = 2.0
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    soft = [-(sig(t / temperature) * math.log(sig(s / temperature))
              + (1 - sig(t / temperature)) * math.log(1 - sig(s / temperature)))
            for srow, trow in zip(S.tolist(), T.tolist()) for s, t in zip(srow, trow)]
    assert soft_bce(S, T, temperature).item() == pytest.approx(sum(soft) / len(soft) * temperature ** 2, rel=1e-6)
    hard = [-(math.log(sig(s)) if t > 0 else math.log(1 - sig(s)))
            for srow, trow in zip(S.tolist(), T.tolist()) for s, t in zip(srow, trow)]
    assert hard_bce(S, T).item() == pytest.approx(sum(hard) / len(hard), rel=1e-6)


def test_feature_distances_by_hand():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[0.0, 2.0], [2.0, 2.0]])
    # cosine: orthogonal (1 - 0) and parallel (1 - 1): mean 0.5
    assert feature_distance(a, b, "cosine").item() == pytest.approx(0.5)
    assert feature_distance(a, b, "mse").item() == pytest.approx((1 + 4 + 1 + 1) / 4)


def test_agreement_counts_same_top_class_and_same_tag_sets():
    assert get_task("multiclass").predicts_same(S, T).tolist() == [False, True]
    assert get_task("multilabel").predicts_same(S, T).tolist() == [True, False]  # tags {0, 1} both; {0, 1, 2} vs {2}
    assert get_task("multilabel").predicts_same(T, T * 2).tolist() == [True, True]


def test_conversion_gives_what_the_teachers_own_normalisation_and_resize_give():
    torch.manual_seed(0)
    raw = torch.randint(0, 256, (2, 3, 12, 12)).float() / 255
    s_mean, s_std, t_mean, t_std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3], [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    student = (raw - torch.tensor(s_mean).view(1, 3, 1, 1)) / torch.tensor(s_std).view(1, 3, 1, 1)
    teacher = (raw - torch.tensor(t_mean).view(1, 3, 1, 1)) / torch.tensor(t_std).view(1, 3, 1, 1)
    same_size = InputConversion(s_mean, s_std, t_mean, t_std, 12, 12)
    assert torch.allclose(same_size(student), teacher, atol=1e-5)
    larger = InputConversion(s_mean, s_std, t_mean, t_std, 12, 20)
    expected = F.interpolate(teacher, size=(20, 20), mode="bilinear", align_corners=False)
    assert larger(student).shape == (2, 3, 20, 20) and torch.allclose(larger(student), expected, atol=1e-5)
    identity = InputConversion(s_mean, s_std, s_mean, s_std, 12, 12)
    assert identity.identity_affine and identity(student) is student


def tiny_teacher(classes, outputs=None) -> Teacher:
    import timm

    torch.manual_seed(1)
    model = timm.create_model("test_resnet", num_classes=outputs or len(classes))
    freeze(model)
    identity = {"source": "t.pt", "kind": "checkpoint", "sha256": "0" * 64, "num_outputs": outputs or len(classes)}
    return Teacher(model, list(classes), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], 16, identity)


@pytest.mark.parametrize("kind", ["soft", "hard", "feature"])
def test_distiller_loss_weights_the_terms_and_the_teacher_gets_no_gradient(kind):
    import timm

    torch.manual_seed(0)
    student = timm.create_model("test_resnet", num_classes=3)
    teacher = tiny_teacher(["a", "b", "c"])
    conversion = InputConversion([0.5] * 3, [0.25] * 3, teacher.mean, teacher.std, 12, 16)
    distiller = Distiller(teacher, conversion, kind, 4.0, 0.25, get_task("multiclass"), student, "cosine")
    images, targets = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 0])
    logits = student(images)
    task = F.cross_entropy(logits, targets)
    loss = distiller.loss(logits, images, task)
    with torch.no_grad():
        teacher_logits = teacher.model(conversion(images))
    if kind != "feature":  # the feature term is checked by its parts below
        term = soft_kl(logits, teacher_logits, 4.0) if kind == "soft" else hard_ce(logits, teacher_logits)
        assert loss.item() == pytest.approx((0.75 * task + 0.25 * term).item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in teacher.model.parameters())
    assert not teacher.model.training
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    # the objective's state (last.pt's `distill`) names the teacher, never holds its weights; the projection's are
    record = distiller.state_dict()
    assert set(record) <= {"teacher", "teacher_metrics", "projection"} and record["teacher"]["sha256"]
    if kind == "feature":
        assert set(record["projection"]) == {"weight", "bias"}
        assert [p.shape for p in distiller.parameters()] == [p.shape for p in distiller.projection.parameters()]
        assert distiller.projection.weight.grad is not None
        features = student.forward_head(student.forward_features(images), pre_logits=True)
        with torch.no_grad():
            teacher_features = teacher.model.forward_head(teacher.model.forward_features(conversion(images)),
                                                          pre_logits=True)
        by_hand = (1 - F.cosine_similarity(distiller.projection(features), teacher_features, dim=1)).mean()
        assert loss.item() == pytest.approx((0.75 * task + 0.25 * by_hand).item(), rel=1e-5)
    else:
        assert "projection" not in record and distiller.parameters() == []


def eval_student_and_distiller() -> tuple:
    """An eval-mode 3-class student and a soft Distiller with `tiny_teacher` (the same preprocessing)."""
    import timm

    torch.manual_seed(0)
    student = timm.create_model("test_resnet", num_classes=3).eval()
    teacher = tiny_teacher(["a", "b", "c"])
    conversion = InputConversion(teacher.mean, teacher.std, teacher.mean, teacher.std, 16, 16)
    return student, teacher, Distiller(teacher, conversion, "soft", 4.0, 0.5, get_task("multiclass"), student)


def test_the_done_line_names_the_teacher_and_the_agreement_only_when_distilled():
    from imgcls.training.reporter import objective_text

    summary = {"teacher": {"source": "runs/big/best.pt", "kind": "checkpoint", "top1": 91.5, "top5": 99.0}}
    assert objective_text(summary, 87.25) == (
        " | teacher runs/big/best.pt top1 91.50 top5 99.00, agreement 87.25% at the last validation")
    assert objective_text({}, 87.25) == ""


def test_agreement_probe_counts_only_readable_images():
    student, teacher, distiller = eval_student_and_distiller()
    probe = AgreementProbe(student, distiller)
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        logits = probe(images)
        probe.count(logits, None, torch.tensor([True, True, True, False]), None)
        same = (student(images).argmax(1) == teacher.model(images).argmax(1))[:3]
    assert probe.read() == pytest.approx(100.0 * same.sum().item() / 3)


def test_later_validations_read_the_teachers_kept_predictions_and_count_the_same():
    from imgcls.compute.device import DeviceInput
    from imgcls.evaluation.evaluate import evaluate

    student, teacher, distiller = eval_student_and_distiller()
    batches = [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 0]),
                torch.tensor([True, True, False, True]), torch.tensor([4 * b + 3, 4 * b + 2, 4 * b + 1, 4 * b]))
               for b in range(3)]
    device_input = DeviceInput(torch.device("cpu"), tuple(teacher.mean), tuple(teacher.std), False, None)
    runs = []
    real = distiller.teacher_forward
    distiller.teacher_forward = lambda images: runs.append(len(images)) or real(images)
    agreements = []
    for _ in range(3):
        probe = AgreementProbe(student, distiller)
        evaluate(probe, batches, device_input, get_task("multiclass"), ["a", "b", "c"], on_outputs=probe.count)
        agreements.append(probe.read())
    assert runs == [4, 4, 4]  # the first pass only
    assert agreements[0] == agreements[1] == agreements[2]
    by_hand = []
    for images, _, valid, _ in batches:
        x = device_input.prepare(images)
        with torch.no_grad():
            by_hand += (student(x).argmax(1) == teacher.model(x).argmax(1))[valid].tolist()
    assert agreements[0] == pytest.approx(100.0 * sum(by_hand) / len(by_hand))


def test_kept_teacher_predictions_grow_by_index_and_stay_under_their_bound():
    kept = TeacherPredictions()
    kept.store(torch.tensor([5, 1]), torch.tensor([2, 0], dtype=torch.int32))
    kept.store(torch.tensor([40]), torch.tensor([1], dtype=torch.int32))  # grows
    kept.pass_done()
    assert kept.usable() and kept.lookup(torch.tensor([40, 1, 5])).tolist() == [1, 0, 2]
    tags = TeacherPredictions()
    tags.store(torch.tensor([0, 2]), torch.tensor([[True, False], [False, True]]))
    tags.pass_done()
    assert get_task("multilabel").same_prediction(tags.lookup(torch.tensor([2, 0])),
                                                  torch.tensor([[False, True], [True, True]])).tolist() == [True, False]
    capped = TeacherPredictions(max_bytes=64)  # 16 int32 rows: growth stops at the cap
    capped.store(torch.tensor([9]), torch.tensor([1], dtype=torch.int32))
    capped.store(torch.tensor([15]), torch.tensor([2], dtype=torch.int32))
    capped.pass_done()
    assert capped.usable() and len(capped.rows) == 16 and capped.lookup(torch.tensor([15])).tolist() == [2]
    small = TeacherPredictions(max_bytes=64)
    small.store(torch.tensor([3]), torch.tensor([1], dtype=torch.int32))
    small.store(torch.tensor([16]), torch.tensor([1], dtype=torch.int32))
    small.pass_done()
    assert not small.usable() and small.rows is None  # the teacher runs at every validation instead
    unindexed = TeacherPredictions()
    unindexed.store(None, torch.tensor([1], dtype=torch.int32))
    unindexed.pass_done()
    assert not unindexed.usable()


def test_class_mismatch_names_the_first_difference_and_another_head_size():
    assert class_mismatch(tiny_teacher(["a", "b", "c"]), ["a", "b", "c"]) is None
    assert "class 1 is 'c' for the teacher and 'b'" in class_mismatch(tiny_teacher(["a", "c", "b"]), ["a", "b", "c"])
    assert "4 outputs, the student's 3 classes" in class_mismatch(tiny_teacher(["a", "b", "c", "d"]), ["a", "b", "c"])
    nameless = tiny_teacher(["a", "b", "c"])
    nameless.classes = None
    assert "records no class names" in class_mismatch(nameless, ["a", "b", "c"])


def test_a_teacher_of_the_other_task_is_refused_both_ways():
    from types import SimpleNamespace

    from imgcls.objectives.teacher import teacher_mismatch

    single, multi = (SimpleNamespace(data=SimpleNamespace(task=task)) for task in ("multiclass", "multilabel"))
    tagger = tiny_teacher(["a", "b", "c"])
    tagger.task = "multilabel"
    assert "trained for data.task=multilabel and the student trains for data.task=multiclass" in \
        teacher_mismatch(tagger, single, ["a", "b", "c"])
    assert "data.task=multiclass and the student trains for data.task=multilabel" in \
        teacher_mismatch(tiny_teacher(["a", "b", "c"]), multi, None)  # the batch finder's check: no classes
    assert teacher_mismatch(tagger, multi, ["a", "b", "c"]) is None


def test_teacher_load_errors_name_distill_teacher_not_the_students_keys(tmp_path):
    import timm
    from timm.models import save_for_hf

    from imgcls.core.errors import CheckpointError, ConfigError, ModelError
    from imgcls.objectives.teacher import load_teacher

    for missing in (str(tmp_path / "runs" / "x" / "best.pt"), "runs/nothere/best.pt", f"local-dir:{tmp_path / 'no'}"):
        with pytest.raises(ConfigError, match=r"'distill.teacher' = .*: no such file or folder") as caught:
            load_teacher(missing, torch.device("cpu"))
        assert "model.name" not in str(caught.value)
    gray = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    gray.pretrained_cfg = dict(gray.pretrained_cfg, mean=(0.5,), std=(0.25,), input_size=(1, 32, 32))
    save_for_hf(gray, str(tmp_path / "gray"), safe_serialization=True, model_config={"label_names": ["a", "b", "c"]})
    with pytest.raises((ConfigError, CheckpointError), match=r"^'distill.teacher' = local-dir:.*gray: the teacher does not load: "
                                          r".*'data.mean' .* \(in the teacher's own record\)"):
        load_teacher(f"local-dir:{tmp_path / 'gray'}", torch.device("cpu"))
    with pytest.raises((ConfigError, ModelError), match=r"^'distill.teacher' = no_such_net_xyz: ") as caught:
        load_teacher("no_such_net_xyz", torch.device("cpu"))
    assert "'model.name'" not in str(caught.value)


def test_a_timm_folder_teacher_is_another_teacher_when_its_config_json_changes(tmp_path):
    from conftest import write_pretrained_folder

    from imgcls.objectives.teacher import load_teacher, teacher_change

    folder = tmp_path / "teacher"
    write_pretrained_folder(folder, "test_resnet", num_classes=3, label_names=["a", "b", "c"])
    before = load_teacher(f"local-dir:{folder}", torch.device("cpu")).identity
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_cfg"]["mean"] = [0.1, 0.1, 0.1]
    config["pretrained_cfg"]["input_size"] = [3, 64, 64]
    (folder / "config.json").write_text(json.dumps(config))
    after = load_teacher(f"local-dir:{folder}", torch.device("cpu")).identity
    assert before["sha256"] == after["sha256"]  # the same weights
    assert "its config.json (preprocessing, input size, labels) changed" in teacher_change(before, after)
    assert teacher_change(before, dict(before)) is None
    older = {k: v for k, v in before.items() if k != "config_sha256"}  # a last.pt written before it was hashed
    assert teacher_change(older, after) is None


def test_a_teacher_far_larger_than_the_student_is_warned_with_its_cost(caplog):
    import logging

    import timm

    from imgcls.objectives.teacher import forward_profile, warn_costly_size

    model = timm.create_model("test_resnet", num_classes=3).eval()
    outputs, at_64 = forward_profile(model, 64, torch.device("cpu"))
    _, at_128 = forward_profile(model, 128, torch.device("cpu"))
    assert outputs == 3 and at_128 == 4 * at_64 > 0  # activations grow with the pixels
    warn_costly_size.cache_clear()
    with caplog.at_level(logging.WARNING, logger="imgcls.objectives.teacher"):
        warn_costly_size("big.pt", 2048, 512 * 2**20, 32, 2)
        warn_costly_size("near.pt", 64, at_64, 32, 2)  # 4x the pixels: ordinary
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["distill.teacher big.pt runs at 2048 px, 4096x the pixels of the student's 32 px: in every "
                        "training step its largest activation alone takes 512 MiB per image, 1.00 GiB at "
                        "train.batch_size=2. A teacher recorded at a size nearer the student's costs less"]


@pytest.mark.parametrize("override, key", [("distill.type=logit", "distill.type"),
                                           ("distill.temperature=0", "distill.temperature"),
                                           ("distill.temperature=1e-300", "distill.temperature"),
                                           ("distill.temperature=0.01", "distill.temperature"),
                                           ("distill.alpha=1.5", "distill.alpha"),
                                           ("distill.feature_loss=l1", "distill.feature_loss"),
                                           ("distill.teacher=''", "distill.teacher")])
def test_bad_distill_values_are_config_errors_naming_the_key(override, key):
    from imgcls.config import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("base", [override])


# ---------------------------------------------------------------- whole runs (slow)

COUNTS = {"a": (12, 3), "b": (12, 3), "c": (12, 3)}
TEACHER = {"model.name": "test_resnet", "train.epochs": 1, "output.tensorboard": "true"}
# the student at another input size and normalisation than the teacher: the conversion is on the path
STUDENT = {"model.name": "test_resnet", "data.img_size": 12, "data.mean": "[0.5,0.5,0.5]", "data.std": "[0.25,0.25,0.25]",
           "output.tensorboard": "true"}


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> tuple[Path, Path]:
    """(data root, the teacher's best.pt), 1 epoch at 16 px."""
    base = tmp_path_factory.mktemp("distill")
    data = make_tree(base / "data", COUNTS)
    result = run_script("train.py", "--config", "base", *tiny_overrides(data, base / "teacher", **TEACHER))
    assert result.returncode == 0, result.stderr[-2000:]
    return data, base / "teacher" / "best.pt"


@pytest.fixture(scope="module")
def student_run(teacher_run, tmp_path_factory) -> tuple[Path, str]:
    data, teacher = teacher_run
    out = tmp_path_factory.mktemp("student") / "run"
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(data, out, **STUDENT, **{"distill.teacher": str(teacher)}))
    assert result.returncode == 0, result.stderr[-2000:]
    return out, result.stderr


def copy_checkpoint(source: Path, target: Path, **changes) -> Path:
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    ckpt.update(changes)
    torch.save(ckpt, target)
    return target


@pytest.mark.slow
def test_distilled_run_logs_the_teacher_and_the_agreement_everywhere(student_run, teacher_run):
    out, log = student_run
    summary = json.loads((out / "summary.json").read_text())
    teacher = summary["teacher"]
    import hashlib
    assert teacher["source"] == str(teacher_run[1]) and teacher["kind"] == "checkpoint"
    assert teacher["sha256"] == hashlib.sha256(teacher_run[1].read_bytes()).hexdigest()
    assert 0 <= teacher["top1"] <= 100 and teacher["num_samples"] == 9
    assert f"teacher {teacher_run[1]} validated: top1 {teacher['top1']:.2f}" in log
    assert "mean/std converted, resized to 16 px" in log
    assert "of step time" in log and "teacher agreement" in log
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    agreement = [float(r["val_teacher_agreement"]) for r in rows]
    done = next(line for line in log.splitlines() if "INFO done: " in line)
    assert (f"| teacher {teacher_run[1]} top1 {teacher['top1']:.2f}" in done
            and f"agreement {agreement[-1]:.2f}% at the last validation" in done), done
    assert len(agreement) == 2 and all(0 <= a <= 100 for a in agreement)
    assert all(a * 9 / 100 == pytest.approx(round(a * 9 / 100)) for a in agreement)  # a share of 9 images
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("val/teacher_agreement")] == pytest.approx(agreement, abs=1e-4)
    assert events.Scalars("train/teacher_time_frac")


@pytest.mark.slow
def test_the_teacher_is_in_neither_last_pt_nor_best_pt(student_run, teacher_run):
    import timm

    out, _ = student_run
    student_keys = set(timm.create_model("test_resnet", num_classes=3).state_dict())
    last = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    best = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    assert set(last["model"]) == set(best["model"]) == student_keys
    assert set(last["distill"]) == {"teacher", "teacher_metrics"}  # identity and figures; no tensors (soft)
    assert "distill" not in best
    teacher_weights = torch.load(teacher_run[1], map_location="cpu", weights_only=True)["model"]
    # the student was trained: none of its tensors is the teacher's
    assert not all(torch.equal(best["model"][k], teacher_weights[k]) for k in student_keys
                   if best["model"][k].is_floating_point())
    # the exported student is any model: eval.py reads best.pt without the teacher
    gone = copy_checkpoint(out / "best.pt", out.parent / "moved.pt")
    result = run_script("eval.py", "--checkpoint", str(gone), "--data", str(teacher_run[0]),
                        "--json", str(out.parent / "eval.json"))
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_another_teacher_or_distill_setting_is_refused_on_resume(student_run, teacher_run, tmp_path):
    """The teacher is compared by its digest: other weights are refused (exit 2), a moved copy resumes."""
    out, _ = student_run
    data, teacher = teacher_run

    def resume(**distill):
        args = tiny_overrides(data, out, **STUDENT, **{f"distill.{k}": v for k, v in distill.items()})
        return run_script("train.py", "--config", "base", *args, "--resume", "auto")

    weights = torch.load(teacher, map_location="cpu", weights_only=True)["model"]
    other = copy_checkpoint(teacher, tmp_path / "other.pt",
                            model={k: (v + 0.01 if v.is_floating_point() else v) for k, v in weights.items()})
    result = resume(teacher=str(other))
    assert result.returncode == 2 and "another teacher than the checkpoint's" in result.stderr
    result = resume(teacher="null")
    assert result.returncode == 2 and f"the checkpoint was distilled from {teacher}" in result.stderr
    result = resume(teacher=str(teacher), alpha=0.3)
    assert result.returncode == 2 and "distill.alpha: 0.5 -> 0.3" in result.stderr
    moved = tmp_path / "moved.pt"
    moved.write_bytes(teacher.read_bytes())
    result = resume(teacher=str(moved))
    assert result.returncode == 0 and "is complete" in result.stderr


@pytest.mark.slow
def test_a_teacher_with_other_classes_exits_2_naming_the_first_difference(teacher_run, tmp_path):
    data, teacher = teacher_run
    other = copy_checkpoint(teacher, tmp_path / "other_classes.pt", classes=["a", "x", "c"])
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(data, tmp_path / "run", **STUDENT, **{"distill.teacher": str(other)}))
    assert result.returncode == 2
    assert "class 1 is 'x' for the teacher and 'b' for the student" in result.stderr
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.slow
def test_a_teacher_with_another_class_count_is_refused_before_the_batch_finder_and_tune(teacher_run, tmp_path):
    """The teacher has 3 outputs, the student's data 4 classes: exit 2 before any search or sweep (it was a
    RuntimeError, exit 1, inside the batch finder's first step)."""
    _, teacher = teacher_run
    data = make_tree(tmp_path / "four", {c: (6, 2) for c in "abcd"})
    out = tmp_path / "run"
    args = tiny_overrides(data, out, **STUDENT, **{"distill.teacher": str(teacher), "train.batch_size": "auto"})
    for script, extra in (("train.py", []), ("tune.py", ["--batch-sizes", "2,4"])):
        result = run_script(script, "--config", "base", *args, *extra)
        assert result.returncode == 2, (script, result.stderr[-2000:])
        assert "its classifier has 3 outputs, the student's 4 classes" in result.stderr
        assert "Traceback" not in result.stderr and "searching the largest batch" not in result.stderr
    assert not (out / "batch_finder.json").exists()


@pytest.mark.slow
def test_refused_teachers_leave_no_run_directory(teacher_run, tmp_path):
    """A missing teacher file, a multi-label teacher for a single-label student: exit 2 naming
    distill.teacher, before output.dir or its train.log exist."""
    data, teacher = teacher_run
    ckpt = torch.load(teacher, map_location="cpu", weights_only=True)
    ckpt["config"]["data"].update({"task": "multilabel", "format": "csv", "train_csv": "t.csv", "val_csv": "v.csv"})
    tagger = tmp_path / "tagger.pt"
    torch.save(ckpt, tagger)
    for source, said in ((str(tmp_path / "gone" / "best.pt"), "no such file or folder"),
                         (str(tagger), "trained for data.task=multilabel and the student trains for data.task=multiclass")):
        out = tmp_path / "run"
        result = run_script("train.py", "--config", "base",
                            *tiny_overrides(data, out, **STUDENT, **{"distill.teacher": source}))
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"'distill.teacher' = {source}" in result.stderr and said in result.stderr, result.stderr[-2000:]
        assert "'model.name'" not in result.stderr
        assert not out.exists()


@pytest.mark.slow
def test_a_timm_folder_teacher_trains_a_feature_student(teacher_run, tmp_path):
    """The teacher exported as a timm folder (export.py --format timm) teaches through `local-dir:`; the
    feature projection is in last.pt and the optimizer, never in best.pt."""
    data, teacher = teacher_run
    folder = tmp_path / "teacher_timm"
    result = run_script("export.py", "--checkpoint", str(teacher), "--format", "timm", "--output", str(folder))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "run"
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(data, out, **STUDENT, **{"distill.teacher": f"local-dir:{folder}",
                                                                 "distill.type": "feature", "train.epochs": 1}))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "timm folder teacher local-dir:" in result.stderr
    last = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    best = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    assert set(last["distill"]["projection"]) == {"weight", "bias"}
    assert len(last["optimizer"]["param_groups"]) == 3  # decayed, not decayed, the projection
    assert not any("projection" in k for k in best["model"]) and "distill" not in best


def test_tune_measures_steps_with_the_teacher(tmp_path):
    """tune.py's batch finder and sweep build their step with the teacher: its forward is in what they time
    and its weights and activations in the memory they measure."""
    from conftest import write_pretrained_folder

    from imgcls.training.batch_finder import TrainingStepProbe

    folder = tmp_path / "teacher"
    write_pretrained_folder(folder, "test_resnet", num_classes=3, label_names=["a", "b", "c"])
    cfg = load_config("base", [f"distill.teacher=local-dir:{folder}", "model.name=test_resnet", "data.img_size=16",
                               "train.device=cpu", "train.amp=none"])
    probe = TrainingStepProbe(cfg, 3, torch.device("cpu"), None, steps=1, warmup=0)
    objective = probe.step.objective
    assert objective.name == "distill" and objective.teacher.size == 160
    calls = []
    real = objective.teacher_forward
    objective.teacher_forward = lambda images: calls.append(images.shape) or real(images)
    assert probe(2).seconds > 0
    assert calls and calls[0] == (2, 3, 16, 16)


def test_the_agreement_probe_leaves_the_student_in_its_mode():
    from imgcls.compute.device import DeviceInput
    from imgcls.evaluation.evaluate import evaluate

    student, teacher, distiller = eval_student_and_distiller()  # an eval-mode student, as an EMA copy
    probe = AgreementProbe(student, distiller)
    batch = (torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1]),
             torch.tensor([True, True]), torch.tensor([0, 1]))
    device_input = DeviceInput(torch.device("cpu"), tuple(teacher.mean), tuple(teacher.std), False, None)
    sums, _ = evaluate(probe, [batch], device_input, get_task("multiclass"), ["a", "b", "c"], on_outputs=probe.count)
    assert not student.training and not teacher.model.training
    assert sums.compute()["num_samples"] == 2 and 0 <= probe.read() <= 100


def test_the_teachers_time_share_is_over_training_time_only():
    from imgcls.objectives.distillation import StepTimer

    timer = StepTimer(torch.device("cpu"))
    assert timer.take_share() is None  # no teacher forward yet
    mark = timer.start()
    timer.stop(mark)
    share = timer.take_share()
    assert share is not None and 0 <= share <= 1
    timer.pause()  # a validation pass follows: its time is not in the next share
    assert timer.take_share() is None


def test_the_input_conversion_takes_the_runs_channel_count():
    student = torch.randn(2, 1, 12, 12)
    conversion = InputConversion([0.5], [0.2], [0.4], [0.25], 12, 12)
    assert torch.allclose(conversion(student), (student * 0.2 + 0.5 - 0.4) / 0.25, atol=1e-6)


@pytest.mark.slow
def test_a_one_channel_teacher_teaches_a_one_channel_student_and_another_count_is_refused(tmp_path):
    """main: exit 2, 'the teacher does not run on a 3-channel 16 px image' (the probe always had 3 channels)."""
    from PIL import Image

    from imgcls.core.errors import ConfigError
    from imgcls.objectives.teacher import check_teacher

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 3)):
        for label, name in enumerate("ab"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(rng.normal(70 + 110 * label, 20, (20, 20)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / name / f"{i}.png")
    grey = {"data.channels": 1, "train.epochs": 1, "model.name": "test_resnet"}
    teacher = run_script("train.py", "--config", "base", *tiny_overrides(tmp_path / "data", tmp_path / "t", **grey))
    assert teacher.returncode == 0, teacher.stderr[-2000:]
    source = str(tmp_path / "t" / "best.pt")
    for channels in (1, 2, 3):
        cfg = load_config("base", tiny_overrides(tmp_path / "data", tmp_path / "x", **{
            "data.channels": channels, "distill.teacher": source}))
        if channels == 1:  # the probe runs the teacher on a 1-channel image: it can teach
            assert check_teacher(cfg).channels == 1
            continue
        with pytest.raises(ConfigError, match=f"it reads 1-channel images and the student's data.channels={channels}"):
            check_teacher(cfg)
