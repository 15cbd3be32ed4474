# syntax=docker/dockerfile:1
# The rollout-reassembler stage image (docs/operations.md).
#
# CPU (default): torch's CPU-only wheel, no CUDA libraries.
#   docker build -t rollout-reassembler:0.1.0 .
# CUDA (finalize.device: cuda or auto; row tensors and route execution on the GPU):
#   docker build -t rollout-reassembler:0.1.0-cuda --build-arg TORCH_INDEX_URL= .
#   PyPI's torch wheel brings the CUDA runtime libraries it was built against (as pip packages,
#   pinned in constraints.txt), so the base stays python:3.11-slim: a CUDA base image would be a
#   second copy of CUDA. The host needs only the NVIDIA driver and container toolkit
#   (docker-compose.gpu.yml reserves the GPU).
#
# Reproducible: constraints.txt (`make constraints`, uv pip compile of pyproject.toml) pins every
# dependency; they are installed in a layer before the source is copied, so a source change
# reuses it. BASE_IMAGE swaps the base (tools/docker/images.sh builds a local one where no
# registry answers, and serves the wheels over WHEELHOUSE_URL); a base without ${PYTHON} gets it
# from its apt sources.
#
# The compiled verification loops (stage._native, built from native/ by setup.py) need a Rust
# toolchain, crates from crates.io and a C linker at build time only: the install RUN below
# fetches them, builds, and removes them again, so the image carries none of it. A mirror:
# RUSTUP_DIST_SERVER (rustup), cargo's own settings for crates. Where neither can be reached,
#   docker build --build-arg RUST_TOOLCHAIN= .
# builds the image without the extension: the contract then runs its pure-Python loops (the
# same results, verification ~1.1-1.3x slower; docs/performance.md), and the build says so.
#
# Configuration: environment variables ROLLOUT_REASSEMBLER_* and/or a YAML file
# (`run --config /etc/rollout-reassembler/stage.yaml`), docs/configuration.md. The image serves
# /metrics, /healthz and /readyz on ROLLOUT_REASSEMBLER_METRICS_PORT (9400); the environment
# overrides the YAML, so change the port with that variable, not with metrics_port in the file.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# The interpreter to build the virtual environment with (installed with apt when the base lacks it).
ARG PYTHON=python3.11
# Where pip takes torch from besides PyPI: the CPU-only wheels by default (the CPU wheel's version,
# 2.x.y+cpu, sorts above PyPI's 2.x.y, so pip takes it). Empty: PyPI's torch, with CUDA.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A local wheel directory served over HTTP (tools/docker/images.sh): pip then uses only it.
ARG WHEELHOUSE_URL=""
ARG UID=10001
# The Rust toolchain that builds stage._native (empty: no extension) and where rustup gets it.
ARG RUST_TOOLCHAIN=1.95.0
ARG RUSTUP_DIST_SERVER=https://static.rust-lang.org

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
# Dependencies first, pinned by constraints.txt: this layer is reused until pyproject.toml or the
# constraints change (torch alone is hundreds of MB). The dependency list is pyproject.toml's;
# setuptools (pinned too) builds the package below without network access.
COPY pyproject.toml constraints.txt ./
# Versions: constraints.txt (DL3013).
# hadolint ignore=DL3013
RUN set -eux; \
    python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt; \
    if [ -n "${WHEELHOUSE_URL}" ]; then \
        set -- --no-index --find-links "${WHEELHOUSE_URL}"; \
    elif [ -n "${TORCH_INDEX_URL}" ]; then \
        set -- --extra-index-url "${TORCH_INDEX_URL}"; \
    fi; \
    pip install "$@" -c constraints.txt -r /tmp/requirements.txt "setuptools>=77" \
        "setuptools-rust==1.13.0" "semantic-version==2.10.0"; \
    rm /tmp/requirements.txt

COPY README.md setup.py MANIFEST.in ./
COPY native ./native
COPY schemas ./schemas
COPY stage ./stage
# The Avro contract is package data (stage/wire/avsc links to schemas/, so both are copied);
# it is loaded once at build time to prove the installed package finds it. With RUST_TOOLCHAIN
# set, the build fails unless stage._native was built (setup.py's extension is optional) and
# loads once the toolchain and linker are gone (`-I`: the installed package, not /src/stage).
# hadolint ignore=DL3008,DL3013
RUN set -eux; \
    linker=no; \
    if [ -n "${RUST_TOOLCHAIN}" ]; then \
        if ! command -v cc >/dev/null 2>&1; then \
            linker=installed; \
            apt-get update; \
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev; \
            rm -rf /var/lib/apt/lists/*; \
        fi; \
        export RUSTUP_HOME=/tmp/rust CARGO_HOME=/tmp/rust PATH="/tmp/rust/bin:${PATH}"; \
        python -c 'import platform, sys, urllib.request; urllib.request.urlretrieve(sys.argv[1] % platform.machine(), sys.argv[2])' \
            "${RUSTUP_DIST_SERVER}/rustup/dist/%s-unknown-linux-gnu/rustup-init" /tmp/rustup-init; \
        chmod +x /tmp/rustup-init; \
        /tmp/rustup-init -y --no-modify-path --profile minimal --default-toolchain "${RUST_TOOLCHAIN}"; \
    fi; \
    pip install --no-deps --no-build-isolation .; \
    rm -rf build; \
    if [ -n "${RUST_TOOLCHAIN}" ]; then \
        rm -rf /tmp/rust /tmp/rustup-init; \
        if [ "${linker}" = installed ]; then apt-get purge -y --auto-remove gcc libc6-dev; fi; \
        python -I -c 'import stage._native'; \
    fi; \
    python -I -c 'from stage.contract.native import native; print("stage._native:", native.__file__ if native else "not built: Python loops")'; \
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
