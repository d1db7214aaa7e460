"""Issue 50 item 6: one check of what a model file stores beside its weights, for every path that opens one
(a checkpoint, ONNX, a torch.export program, a timm folder; the slim server's refusals are in
tests/serving/test_onnx_only.py): a spoilt field is a CheckpointError (exit 2) naming the file, the field,
its value and what is allowed, before any image is read."""
from __future__ import annotations

import json

import pytest
import torch
from stored_metadata_cases import BAD_METADATA, CLASSES, IMG_SIZE, good_metadata, spoilt, write_onnx

from imgcls.core.errors import USAGE_ERRORS
from imgcls.model_files.loading import load_model_file

IDS = [case for case, _, _ in BAD_METADATA]


def refusal(path) -> str:
    with pytest.raises(USAGE_ERRORS) as info:
        load_model_file(path)
    return str(info.value)


def test_good_metadata_opens_on_every_path(tmp_path, pt2_program, timm_folder):
    for path in (write_onnx(tmp_path / "m.onnx", good_metadata()), write_pt2(tmp_path / "m.pt2", pt2_program,
                                                                            good_metadata()),
                 write_checkpoint(tmp_path / "best.pt", good_metadata()), timm_folder):
        opened = load_model_file(path)
        assert opened.cfg.data.img_size == IMG_SIZE and len(opened.classes) == len(CLASSES), path


@pytest.mark.parametrize("case, changes, named", BAD_METADATA, ids=IDS)
def test_onnx_metadata_is_checked(tmp_path, case, changes, named):
    path = write_onnx(tmp_path / "model.onnx", spoilt(changes))
    said = refusal(path)
    assert named in said and str(path) in said


# ---------------------------------------------------------------- torch.export programs


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, len(CLASSES))

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def pt2_program():
    return torch.export.export(Tiny().eval(), (torch.zeros(2, 3, IMG_SIZE, IMG_SIZE),))


def write_pt2(path, program, metadata: dict):
    from imgcls.model_files.metadata import PT2_METADATA_FILE

    torch.export.save(program, str(path), extra_files={PT2_METADATA_FILE: json.dumps(metadata)})
    return path


@pytest.mark.parametrize("case, changes, named", BAD_METADATA, ids=IDS)
def test_pt2_metadata_is_checked(tmp_path, pt2_program, case, changes, named):
    path = write_pt2(tmp_path / "model.pt2", pt2_program, spoilt(changes))
    said = refusal(path)
    assert named in said and str(path) in said


# ---------------------------------------------------------------- checkpoints (the same keys, beside the weights)


def write_checkpoint(path, metadata: dict):
    torch.save({"model": {}, **{k: v for k, v in metadata.items() if k not in ("format_version", "batch")}},
               str(path))
    return path


CHECKPOINT_CASES = [c for c in BAD_METADATA if c[0] != "fewer classes than outputs"]  # strict load_state_dict


@pytest.mark.parametrize("case, changes, named", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_checkpoint_metadata_is_checked(tmp_path, case, changes, named):
    path = write_checkpoint(tmp_path / "best.pt", spoilt(changes))
    said = refusal(path)
    assert named in said and str(path) in said


# ---------------------------------------------------------------- timm folders (timm's own keys, ours under imgcls)


@pytest.fixture(scope="module")
def timm_folder(tmp_path_factory):
    from conftest import write_pretrained_folder

    folder = tmp_path_factory.mktemp("timm") / "model"
    write_pretrained_folder(folder, num_classes=len(CLASSES), label_names=list(CLASSES))
    config = json.loads((folder / "config.json").read_text())
    metadata = good_metadata()
    config["pretrained_cfg"].update(input_size=[3, IMG_SIZE, IMG_SIZE], crop_pct=0.875, interpolation="bilinear",
                                    mean=metadata["preprocessing"]["mean"], std=metadata["preprocessing"]["std"])
    config["imgcls"] = {k: metadata[k] for k in ("format_version", "config", "epoch", "calibration", "thresholds")}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def spoil_timm_folder(folder, target, changes: dict):
    import shutil

    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if section == "preprocessing":
            config["pretrained_cfg"]["input_size" if name == "img_size" else name] = \
                [3, value, value] if name == "img_size" else value
        elif section == "classes":
            config["label_names"] = value
        elif name:
            config["imgcls"][section][name] = value
        else:
            config["imgcls"][section] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("case, changes, named", BAD_METADATA, ids=IDS)
def test_timm_folder_metadata_is_checked(tmp_path, timm_folder, case, changes, named):
    folder = spoil_timm_folder(timm_folder, tmp_path / "spoilt", changes)
    said = refusal(folder)
    if case == "fewer classes than outputs":  # models.factory's own check of config.json
        named = "num_classes 3 but 2 label_names"
    assert named in said and str(folder) in said
