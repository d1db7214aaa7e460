"""The glue of each command (train.py, eval.py, infer.py, benchmark.py): the top layer."""
