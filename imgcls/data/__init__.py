"""Datasets, image decoding, transforms, samplers and loaders."""
