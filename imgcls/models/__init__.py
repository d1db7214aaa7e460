"""Model factory, normalisation swaps and EMA."""
