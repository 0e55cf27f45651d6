# syntax=docker/dockerfile:1
#
# pagedserve for an NVIDIA GPU host:
#   docker build -t pagedserve .
#   docker run --gpus all -p 8000:8000 pagedserve [pagedserve serve flags...]
#
# Base image: python:3.11-slim-bookworm plus the CUDA build of torch from PyPI. PyPI's Linux
# x86_64 torch wheel *is* the CUDA build and brings the CUDA runtime, cuBLAS and cuDNN with it as
# pip packages (torch 2.13.0 is built with CUDA 13.0: NVIDIA driver >= 580, a Turing or newer
# GPU), so an nvidia/cuda base image would only add a second copy of those libraries, and the
# pytorch/pytorch images bring conda and a torch release we do not choose. The host needs the
# NVIDIA driver and the NVIDIA Container Toolkit, nothing else. Python's minor version and the
# Debian release are pinned here, torch by TORCH_SPEC, everything else by docker/constraints.txt.
# Older drivers or Volta/Pascal GPUs: add a PyTorch CUDA 12.6 wheel index, e.g.
#   docker build --build-arg TORCH_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu126 ...
#
# On the GPU, attention runs the Triton kernels over the paged KV cache (triton comes with the
# torch wheel) and decode steps replay CUDA graphs captured at start-up; the start-up log names
# both ("attention triton, ..., CUDA graphs for decode batches 1..256"). Opt out with
# `--enforce-eager` or `--attention-backend sdpa` after the image name.
#
# One stage: the image's bulk is torch and its CUDA libraries, which the server needs at run
# time; nothing is compiled, so a build stage would only shed pip's cache, which is off anyway.
#
# Every install step is a step of docker/install.sh; tests/docker/test_recipe.py runs the same
# steps (parsed from this file) in a fresh venv on a CPU machine, starts the ENTRYPOINT below
# and gets a completion from it. The CPU build of TORCH_SPEC's version is the only difference.
FROM python:3.11-slim-bookworm

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_EXTRA_INDEX_URL=
# Build time only (ARG, not ENV): no pip cache in the layers.
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1

# HF_HUB_OFFLINE: the server never downloads; the default model is converted at build time
# into PAGEDSERVE_CACHE, so a container starts in seconds with no network.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The server runs as this user; it owns the model cache (so it can also convert a .gguf you
# mount) and /models, where your own model directories are mounted (read-only is fine).
RUN groupadd --gid 1000 pagedserve \
    && useradd --create-home --uid 1000 --gid 1000 --shell /usr/sbin/nologin pagedserve \
    && install -d -o pagedserve -g pagedserve /opt/pagedserve/cache /models

# torch first, in its own layer: it is most of the image and changes least often.
COPY docker/install.sh docker/constraints.txt /opt/pagedserve/docker/
RUN sh /opt/pagedserve/docker/install.sh venv /opt/venv \
    && sh /opt/pagedserve/docker/install.sh torch

# .dockerignore lets in only the packages, pyproject.toml, README.md and docker/.
COPY . /opt/pagedserve/src
RUN sh /opt/pagedserve/docker/install.sh project /opt/pagedserve/src

# Numeric, so the host (and Kubernetes' runAsNonRoot) can tell it is not root.
USER 1000:1000
WORKDIR /home/pagedserve
RUN sh /opt/pagedserve/docker/install.sh convert

EXPOSE 8000
# /health answers 200 once the engine is up (stdlib urllib: the slim image has no curl). It
# checks port 8000; after `--port N` set PAGEDSERVE_HEALTH_URL=http://127.0.0.1:N/health.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/pagedserve/src/docker/healthcheck.py"]
# Flags after the image name are passed on: `docker run ... pagedserve --model /models/m`.
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]
