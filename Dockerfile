# GPU training image: docker build -t imgcls . && \
#   docker run --gpus all --shm-size=8g -v /data:/data -v "$PWD/runs:/app/runs" imgcls train.py --config resnet50 data.root=/data
# Serving (serve.py: POST /predict, GET /health), on a model trained or exported into runs/:
#   docker run -p 8000:8000 -v "$PWD/runs:/app/runs" imgcls serve.py --checkpoint runs/exp/best.pt --host 0.0.0.0
#   (0.0.0.0 inside the container; -p publishes it; add --api-key KEY or -e IMGCLS_API_KEY=KEY off a private network)
# The base image brings CUDA, cuDNN and the torch / torchvision builds that requirements.txt pins.
FROM pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# Everything but torch / torchvision; the base image's builds are kept (a constraint pins them, so a
# dependency that wanted another torch fails the build instead of replacing the CUDA build).
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
