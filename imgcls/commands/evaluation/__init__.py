"""eval.py's work: the evaluation of a model file, its report, the error gallery, the representation figures."""
