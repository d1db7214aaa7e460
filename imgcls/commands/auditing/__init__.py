"""audit.py's work: the data audit and its argument checks."""
