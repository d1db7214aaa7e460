"""A checkpoint written by train.py (`best.pt`, `last.pt`): what every file not named otherwise is taken for.
Read by model_files/checkpoint_files.py; export.py reads it and never writes one."""
from __future__ import annotations

from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.formats.base import ModelFormat

FORMAT = ModelFormat("checkpoint", "a checkpoint", read_checkpoint)
