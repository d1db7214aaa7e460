"""Embeddings and similarity search: pooled pre-logits vectors of images (embed.py), a FAISS index over
them (search.py, serve.py /similar), and the representation figures eval.py --knn / --linear-probe give."""
