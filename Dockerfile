# Two images from one file (docs/container.md):
#
# - the training image (the default, last target): train.py, eval.py, infer.py, export.py, serve.py, ... on
#   the CUDA base that BASE_IMAGE names (torch and torchvision come from the base):
#     docker build -t imgcls .
#     docker run --gpus all --shm-size=8g -v /data:/data -v "$PWD/runs:/app/runs" imgcls \
#         train.py --config resnet50 data.root=/data
#     docker run -p 127.0.0.1:8000:8000 -v "$PWD/runs:/app/runs" imgcls \
#         serve.py --checkpoint runs/exp/best.pt --host 0.0.0.0
# - the slim serving image (--target serve): serve.py for ONNX exports (fp32, int8) with onnxruntime, Pillow,
#   NumPy and FastAPI/uvicorn; no torch, torchvision or CUDA:
#     docker build --target serve -t imgcls-serve .
#     docker run -p 127.0.0.1:8000:8000 -v "$PWD/runs:/app/runs:ro" imgcls-serve \
#         serve.py --checkpoint runs/exp/model.onnx --host 0.0.0.0
#
# Machines without Docker Hub: docker/build-standin-base.sh builds stand-in bases from Debian's packages
# and PyPI; pass them as --build-arg BASE_IMAGE=... --build-arg SERVE_BASE_IMAGE=...
# (BuildKit builds only the stages a target needs; the legacy builder also builds `serve` for the default.)
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
ARG SERVE_BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- the slim serving image
FROM ${SERVE_BASE_IMAGE} AS serve

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

COPY docker/requirements-serve.txt /tmp/requirements-serve.txt
RUN python -m pip install --no-cache-dir -r /tmp/requirements-serve.txt && rm /tmp/requirements-serve.txt

RUN useradd --create-home --uid 1000 --user-group app \
    && mkdir -p /app/runs && chown app:app /app /app/runs

# serve.py and the imgcls package: the ONNX-only path (imgcls/serving/slim.py) imports no torch; its rows are the
# tasks' own (imgcls/tasks/rows.py), the preprocessing imgcls/data/eval_preprocessing.py, the metadata checks
# imgcls/model_files/stored_metadata.py. The torch modules beside them are never imported here.
COPY --chown=app:app serve.py ./
COPY --chown=app:app imgcls/ imgcls/
USER 1000:1000

EXPOSE 8000
ENTRYPOINT ["python"]
CMD ["serve.py", "--help"]

# ---------------------------------------------------------------- the training image (default)
FROM ${BASE_IMAGE} AS train

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# Everything but torch / torchvision; the base image's builds are kept (a constraint pins them, so a
# dependency that wanted another torch fails the build instead of replacing the CUDA build). Before the
# code: a code change rebuilds only the last layers.
COPY requirements.txt .
RUN python -c "from importlib.metadata import version as v; print(f'torch=={v(\"torch\")}\ntorchvision=={v(\"torchvision\")}')" \
        > /tmp/base-torch.txt \
    && grep -viE '^(torch|torchvision)([<>=!~ ;]|$)' requirements.txt > /tmp/requirements-app.txt \
    && python -m pip install --no-cache-dir -c /tmp/base-torch.txt -r /tmp/requirements-app.txt \
    && rm /tmp/base-torch.txt /tmp/requirements-app.txt

# uid 1000 (the usual first user on the host, for bind-mounted folders); Ubuntu 24.04 bases already
# have a user 'ubuntu' with that uid, which makes way.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --user-group app \
    && mkdir -p /app/runs /app/datasets \
    && chown app:app /app /app/runs /app/datasets

COPY --chown=app:app . .

USER 1000:1000

EXPOSE 8000
ENTRYPOINT ["python"]
CMD ["train.py", "--help"]
