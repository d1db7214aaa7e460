"""Where samples come from: one module per source (folder, CSV list, WebDataset shards) with its config keys
beside it (`*_settings.py`), registered in `registry.py`."""
