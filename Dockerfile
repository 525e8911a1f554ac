# Baton: one image for every service (gateway, prefill_worker, decode_worker); compose.yaml picks
# the command. The default model is fetched and converted at build time, so every container
# shares the same cache inside the image and starts without touching the network.
#
#   docker build -t baton .
#   docker build --build-arg TORCH_INDEX_URL=<a CPU wheel index> -t baton .   # smaller, CPU-only torch
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE=/opt/baton/cache \
    TOKENIZERS_PARALLELISM=false

# A C++ compiler for Baton's native CPU kernels (paged decode attention, fused norms), built once at
# first use for the CPU the container runs on; without one Baton runs their torch fallbacks.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, in its own layer. PyPI's Linux x86_64 wheel bundles CUDA libraries (a few
# GB); pass TORCH_INDEX_URL to take the same version from an index of CPU-only builds instead.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /app

# Dependencies from pyproject.toml only (this layer survives code changes).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

# The default model, converted once into $BATON_CACHE (this layer survives code changes too).
COPY baton/fetch.py /tmp/baton-fetch/fetch.py
RUN python -c "import sys; sys.path.insert(0, '/tmp/baton-fetch'); import fetch; print(fetch.fetch_default_model())" \
    && rm -rf /tmp/baton-fetch

# The code.
COPY . .
RUN pip install --no-deps . \
    && baton model fetch \
    && useradd --system --uid 10001 --create-home --home-dir /home/baton baton \
    && chmod -R a+rX "$BATON_CACHE"

# Nothing may reach a model hub at run time: the model is in the image.
ENV HF_HUB_OFFLINE=1
USER baton
# Build the native kernels now for this build host's CPU (a container on another CPU builds its own
# at first start, into the same cache).
RUN python -m baton.engine.kernels
EXPOSE 8000 9100
CMD ["baton", "serve", "--host", "0.0.0.0", "--port", "8000"]
