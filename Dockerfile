# syntax=docker/dockerfile:1
# The rollout-reassembler stage image (README.md, "Operations").
#
# CPU (default):
#   docker build -t rollout-reassembler:0.1.0 .
# CUDA (finalize.device: cuda or auto; row tensors and route execution on the GPU):
#   docker build -t rollout-reassembler:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
#   A base image without Python ${PYTHON} gets it from its apt sources (Ubuntu 22.04: python3.11
#   and python3.11-venv from universe); on an Ubuntu 24.04 base pass --build-arg PYTHON=python3.12.
#
# Configuration: environment variables ROLLOUT_REASSEMBLER_* and/or a YAML file
# (`run --config /etc/rollout-reassembler/stage.yaml`), docs/configuration.md. The image serves
# /metrics, /healthz and /readyz on ROLLOUT_REASSEMBLER_METRICS_PORT (9400); the environment
# overrides the YAML, so change the port with that variable, not with metrics_port in the file.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# The interpreter to build the virtual environment with (installed with apt when the base lacks it).
ARG PYTHON=python3.11
# Where pip takes torch from. The default PyPI torch wheel bundles the CUDA libraries (gigabytes);
# the CPU image takes the CPU-only wheel. Empty: torch from the default index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/stage

# Distribution package versions follow the base image (DL3008).
# hadolint ignore=DL3008
RUN set -eux; \
    if ! command -v "${PYTHON}" >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${PYTHON}" "${PYTHON}-venv" ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    "${PYTHON}" -m venv "${VIRTUAL_ENV}"; \
    groupadd --system --gid "${UID}" stage; \
    useradd --system --uid "${UID}" --gid stage --home-dir /home/stage --create-home \
        --shell /usr/sbin/nologin stage

WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY stage ./stage
# The Avro contract is package data (stage/wire/avsc links to schemas/, so both are copied);
# it is loaded once at build time to prove the installed package finds it.
# Versions: pyproject.toml's bounds (DL3013).
# hadolint ignore=DL3013
RUN set -eux; \
    if [ -n "${TORCH_INDEX_URL}" ]; then pip install --index-url "${TORCH_INDEX_URL}" torch; fi; \
    pip install .; \
    python -c 'from stage.wire import schema_names; print("schemas:", ", ".join(schema_names()))'; \
    rollout-reassembler --help >/dev/null

WORKDIR /home/stage
USER ${UID}:${UID}

ENV ROLLOUT_REASSEMBLER_METRICS_PORT=9400
EXPOSE 9400

# Liveness of the poll loop (/healthz answers 503 once the loop stalls); no curl in slim images.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('ROLLOUT_REASSEMBLER_METRICS_PORT', '9400'), timeout=4)"]

# SIGTERM: finish in-flight groups within revoke_budget_ms, commit, leave the group.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rollout-reassembler"]
CMD ["run"]
