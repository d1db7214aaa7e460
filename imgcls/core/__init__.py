"""The bottom layer: the typed config tree and the project's error types (no torch needed to import)."""
