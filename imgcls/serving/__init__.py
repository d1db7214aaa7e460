"""serve.py's work: an HTTP model server (FastAPI + uvicorn) whose requests are decoded on their own,
then classified together in dynamically formed batches, with the same rows as infer.py."""
