"""The keys of data.format=folder (data/listing/sources/source_folder.py): class-folder trees under data.root."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class FolderSourceKeys:
    FORMAT = "folder"
    FORMAT_HELP = "class-folder trees under data.root"

    train_split: str = setting("train", "training split folder under data.root")
    val_split: str = setting("val", "validation split folder under data.root")
    builtin: Optional[Literal["digits"]] = setting(
        None, "null, or 'digits': write scikit-learn's digits as a class-folder tree into data.root first")

    def check_source(self) -> None:
        self._check_builtin()

    def check_unselected(self) -> None:
        self._check_builtin()

    def _check_builtin(self) -> None:
        if self.builtin and (self.val_fraction is not None or self.format != "folder"):
            raise ConfigError(f"'data.builtin' = {self.builtin} writes its own train/ and val/ folders: drop "
                              f"data.val_fraction and keep data.format=folder")
