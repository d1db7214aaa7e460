#!/usr/bin/env bash
# Stand-in base images for machines that reach only the package registries (Debian, PyPI), not Docker Hub.
#
#   docker/build-standin-base.sh            # both images; each is skipped when its tag already exists
#   FORCE=1 docker/build-standin-base.sh    # rebuild them
#
# - $SLIM_BASE (default imgcls-standin/python:3.11-slim): Debian $SUITE from Debian's packages (mmdebstrap),
#   python3 as `python` on PATH, pip not marked externally managed. Stands in for python:3.11-slim, the base
#   of the slim serving image (Dockerfile --target serve).
# - $TORCH_BASE (default imgcls-standin/pytorch:2.14.1-cuda13.0-cudnn9-runtime): $SLIM_BASE plus
#   torch==$TORCH_VERSION and torchvision==$TORCHVISION_VERSION from the package index (PyPI's Linux wheels
#   bring the CUDA 13 libraries as nvidia-* packages). Stands in for pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime,
#   the training image's default base.
#
# Both carry a copy of this machine's CA bundle (/etc/ssl/certs/ca-certificates.crt, which holds the
# certificate of the machine's package proxy) and a pip.conf that points pip at it, so pip inside the
# containers (the images' own builds) reaches the index as pip on the host does.
#
# Then: docker build --build-arg BASE_IMAGE=$TORCH_BASE --build-arg SERVE_BASE_IMAGE=$SLIM_BASE -t imgcls .
set -euo pipefail

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SLIM_BASE=${SLIM_BASE:-imgcls-standin/python:3.11-slim}
TORCH_BASE=${TORCH_BASE:-imgcls-standin/pytorch:2.14.1-cuda13.0-cudnn9-runtime}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
TORCHVISION_VERSION=${TORCHVISION_VERSION:-0.29.1}
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
FORCE=${FORCE:-0}

have_image() { [ "$FORCE" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }

command -v docker >/dev/null || { echo "docker is not installed (apt-get install docker.io)" >&2; exit 2; }
[ -r "$HOST_CA" ] || { echo "HOST_CA=$HOST_CA: not a readable file" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$HOST_CA" "$work/host-ca.crt"

if have_image "$SLIM_BASE"; then
    echo "$SLIM_BASE exists: kept"
else
    command -v mmdebstrap >/dev/null || { echo "mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 2; }
    # minbase: essential + apt; python3-pip brings pip; ca-certificates the system's own bundle (kept beside ours).
    # The hooks: `python` on PATH, pip not externally managed, our CA bundle for pip, no apt lists or caches.
    mmdebstrap --variant=minbase --format=tar \
        --include=python3,python3-pip,python-is-python3,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
        --customize-hook="install -D -m 0644 $work/host-ca.crt \"\$1\"/etc/ssl/certs/host-ca-bundle.crt" \
        --customize-hook='printf "[global]\ncert = /etc/ssl/certs/host-ca-bundle.crt\n" > "$1"/etc/pip.conf' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$SUITE" "$work/rootfs.tar" "$MIRROR"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python"]' \
        "$work/rootfs.tar" "$SLIM_BASE"
    rm -f "$work/rootfs.tar"
    echo "$SLIM_BASE built"
fi

if have_image "$TORCH_BASE"; then
    echo "$TORCH_BASE exists: kept"
else
    docker build -t "$TORCH_BASE" --build-arg "SLIM_BASE=$SLIM_BASE" \
        --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "TORCHVISION_VERSION=$TORCHVISION_VERSION" \
        -f - "$work" <<'DOCKERFILE'
ARG SLIM_BASE
FROM ${SLIM_BASE}
ARG TORCH_VERSION
ARG TORCHVISION_VERSION
RUN python -m pip install --no-cache-dir --disable-pip-version-check \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"
DOCKERFILE
    echo "$TORCH_BASE built"
fi
