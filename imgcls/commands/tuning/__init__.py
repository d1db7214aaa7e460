"""tune.py's work: the batch sweep, the LR range test, their plots, and the Optuna search's glue."""
