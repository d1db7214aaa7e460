"""A checkpoint written by train.py (`best.pt`, `last.pt`): what every file not named otherwise is taken for.
Read by engine/model_io/checkpoint_files.py; export.py reads it and never writes one."""
from __future__ import annotations

from engine.model_io.checkpoint_files import read_checkpoint
from engine.model_io.formats.base import ModelFormat

FORMAT = ModelFormat("checkpoint", "a checkpoint", read_checkpoint)
