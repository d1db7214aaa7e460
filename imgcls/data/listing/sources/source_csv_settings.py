"""The keys of data.format=csv (data/listing/sources/source_csv.py): CSV lists of image paths and labels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class CsvSourceKeys:
    FORMAT = "csv"
    FORMAT_HELP = "data.train_csv / data.val_csv lists"

    # Paths may move on --resume; the checkpoint's record of the lists' contents decides whether they changed.
    train_csv: Optional[str] = setting(None, "csv: the training list, a header then one row per image (paths "
                                       "relative to data.root, or to the CSV's folder)", resume_free=True)
    val_csv: Optional[str] = setting(None, "csv: the validation list (labels must be training classes)",
                                     resume_free=True)
    csv_path_column: str = setting("path", "csv: the column holding image paths")
    csv_label_column: str = setting("label", "csv: the column holding class names")

    def check_source(self) -> None:
        if not self.train_csv:
            raise ConfigError("'data.format' = csv needs 'data.train_csv' (a CSV file with a header and the columns "
                              f"'{self.csv_path_column}' and '{self.csv_label_column}')")
        if self.val_csv and self.val_fraction is not None:
            raise ConfigError("'data.val_csv' and 'data.val_fraction' are both set: validate on the CSV list or "
                              "hold out a fraction of data.train_csv, not both")
        if not self.val_csv and self.val_fraction is None:
            raise ConfigError("'data.format' = csv needs 'data.val_csv', or 'data.val_fraction' to hold out a "
                              "fraction of data.train_csv")

    def check_unselected(self) -> None:
        if self.train_csv or self.val_csv:
            raise ConfigError(f"'data.train_csv' / 'data.val_csv' are set but 'data.format' = {self.format}; "
                              f"set data.format=csv to train from CSV lists")
