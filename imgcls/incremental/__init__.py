"""Class-incremental training: a run that adds classes to a trained model (docs/incremental.md)."""
