"""`train.py --resume PATH` without `--config`: the run's config as its checkpoint recorded it (resolved), with
the command line's KEY=VALUE overrides on top (the resume rules then refuse the keys a resume may not change)."""
from __future__ import annotations

from imgcls.core.config import Config, apply_dict, apply_overrides, validate
from imgcls.core.errors import CheckpointError, ConfigError


def config_from_checkpoint(path: str, overrides: list[str]) -> Config:
    """The resolved config that `path` (a last.pt) records, then `overrides`; validated. ConfigError (exit 2)
    when the file cannot be read or records no config."""
    from imgcls.core.safe_load import load_checkpoint  # imports torch: only on this path

    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"--resume {path}: {err}") from err
    saved = ckpt.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume {path}: the checkpoint records no config to continue with; pass "
                          f"--config CONFIG and the run's overrides beside --resume")
    cfg = Config()
    apply_dict(cfg, saved, source=f"{path} (its recorded config)")
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg

