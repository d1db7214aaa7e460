"""Embeddings and similarity search: pooled pre-logits vectors of images (embed.py), a FAISS index over
them (search.py, serve.py /similar), and the representation figures eval.py --knn / --linear-probe give."""
import logging

logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its search for CPU-specific builds, line by line
