"""Benchmarking beside benchmark.py: loader and step timing, the torchvision baseline, generated photos.
Never imported by training."""
