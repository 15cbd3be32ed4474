#!/usr/bin/env bash
# Builds the images the tests run, locally and without a registry (tools/docker/README.md):
#   base    Debian bookworm minbase (debootstrap + docker import; needs root)
#   kafka   Apache Kafka from the Maven jars in .cache/kafka/lib, apache/kafka's conventions
#   python  base + Debian's Python 3.11 (stand-in for python:3.11-slim)
#   prometheus  base + the server `make prometheus-bin` unpacked from Debian's package (skipped without it)
#   stage   the project's Dockerfile on the python base, dependencies from a local wheelhouse
#   release cpu|cuda   the image a user takes (`make image`, `make image-cuda`): the same build,
#           tagged rollout-reassembler:<pyproject version>[-cuda] (RELEASE_REPOSITORY renames it),
#           torch from TORCH_INDEX_URL's CPU wheels or from PyPI (CUDA); `release-args` prints it
# Idempotent: each image carries a label with the hash of its inputs and is rebuilt only when
# they change. `images.sh env` prints the variables the tests read (KAFKA_TEST_IMAGE, ...).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tools/docker
LABEL=org.rollout-reassembler.recipe
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
JARS=${ROLLOUT_REASSEMBLER_KAFKA_JARS:-$ROOT/.cache/kafka/lib}
PY=${PY:-$ROOT/.venv/bin/python}
# pip's cache lives outside the clone (CI clones afresh); so does the wheelhouse built from it.
WHEELHOUSE=${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-reassembler/wheelhouse}

# Bump when build_base changes (its inputs are this script, the suite and the mirror).
BASE_RECIPE=1
BASE_IMAGE=rollout-reassembler/debian:$SUITE
KAFKA_IMAGE=rollout-reassembler/kafka:$(sed -n 's|.*<kafka.version>\(.*\)</kafka.version>.*|\1|p' "$ROOT/tools/kafka/pom.xml")
PYTHON_IMAGE=rollout-reassembler/python:3.11-$SUITE
STAGE_IMAGE=rollout-reassembler:dev
PROMETHEUS_BIN=${PROMETHEUS_BIN:-$ROOT/.cache/bin/prometheus}
PROMETHEUS_IMAGE=rollout-reassembler/prometheus:local

log() { printf 'images: %s\n' "$*" >&2; }
hash_of() { (cd "$ROOT" && find "$@" -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha1sum) | sha1sum | cut -c1-16; }
image_id() { docker image inspect -f '{{.Id}}' "$1"; }
current() { [[ "$(docker image inspect -f "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null)" == "$2" ]]; }
timed() { local start=$SECONDS; "$@"; log "$1 $2: $((SECONDS - start)) s"; }

build_base() (
    local recipe; recipe=$(printf 'base-%s %s %s' "$BASE_RECIPE" "$SUITE" "$MIRROR" | sha1sum | cut -c1-16)
    current "$BASE_IMAGE" "$recipe" && return
    [[ $(id -u) == 0 ]] && command -v debootstrap >/dev/null || { log "base: needs root and debootstrap"; return 1; }
    local dir; dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    log "debootstrap --variant=minbase $SUITE (about 40 s)"
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; return 1; }
    cat >"$dir/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SOURCES
    # no recommends, no docs: keeps every image built on it small
    printf 'APT::Install-Recommends "false";\n' >"$dir/etc/apt/apt.conf.d/90norecommends"
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin
    rm -f "$dir.log"
    tar -C "$dir" --numeric-owner -c . | docker import \
        --change "LABEL $LABEL=$recipe" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
)

# docker build with the host's network (the engine here has no bridge) and the recipe label
build() {
    local tag=$1 recipe=$2; shift 2
    docker build --network host --label "$LABEL=$recipe" -t "$tag" "$@" >&2
}

build_kafka() (
    ls "$JARS"/kafka_2.13-*.jar >/dev/null 2>&1 || { log "kafka: no jars in $JARS (make kafka-jars)"; return 1; }
    local recipe; recipe=$( (hash_of tools/docker/kafka; ls "$JARS"; image_id "$BASE_IMAGE") | sha1sum | cut -c1-16)
    current "$KAFKA_IMAGE" "$recipe" && return
    local ctx; ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' EXIT
    cp -a "$HERE/kafka/." "$ctx/"
    mkdir "$ctx/libs"
    cp -l "$JARS"/*.jar "$ctx/libs/" 2>/dev/null || cp "$JARS"/*.jar "$ctx/libs/"
    build "$KAFKA_IMAGE" "$recipe" --build-arg "BASE_IMAGE=$BASE_IMAGE" "$ctx"
)

build_python() {
    local recipe; recipe=$( (hash_of tools/docker/python; image_id "$BASE_IMAGE") | sha1sum | cut -c1-16)
    current "$PYTHON_IMAGE" "$recipe" && return
    build "$PYTHON_IMAGE" "$recipe" --build-arg "BASE_IMAGE=$BASE_IMAGE" "$HERE/python"
}

build_prometheus() (
    [[ -x "$PROMETHEUS_BIN" ]] || { log "prometheus: no $PROMETHEUS_BIN (make prometheus-bin); skipped"; return 0; }
    local recipe; recipe=$( (hash_of tools/docker/prometheus; sha1sum <"$PROMETHEUS_BIN"; image_id "$BASE_IMAGE") | sha1sum | cut -c1-16)
    current "$PROMETHEUS_IMAGE" "$recipe" && return
    local ctx; ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' EXIT
    cp "$HERE/prometheus/Dockerfile" "$ctx/" && cp "$PROMETHEUS_BIN" "$ctx/prometheus"
    build "$PROMETHEUS_IMAGE" "$recipe" --build-arg "BASE_IMAGE=$BASE_IMAGE" "$ctx"
)

# The stage image's dependencies, as wheels, from pip's cache where `make install` left them:
# served to the build over loopback so the image does not download torch's GBs a second time.
# WHEELHOUSE_INDEX (the CPU release) adds torch's CPU wheel index: its +cpu version sorts first.
wheelhouse() {
    local stamp; stamp="$WHEELHOUSE/.complete-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha1sum | cut -c1-16)"
    [[ -f "$stamp" ]] && return
    mkdir -p "$WHEELHOUSE"
    local index=(); [[ -n "${WHEELHOUSE_INDEX:-}" ]] && index=(--extra-index-url "$WHEELHOUSE_INDEX")
    "$PY" - "$ROOT/pyproject.toml" >"$WHEELHOUSE/requirements.txt" <<'PYTHON'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PYTHON
    # torch's CUDA wheels are GBs: a connection dropped mid-wheel resumes where it stopped
    # (pip's default, 5 resumes, ran out once here) rather than failing the whole suite
    env -u PIP_FIND_LINKS "$PY" -m pip download --quiet --dest "$WHEELHOUSE" --only-binary=:all: \
        --retries 10 --resume-retries 50 "${index[@]}" \
        -c "$ROOT/constraints.txt" -r "$WHEELHOUSE/requirements.txt" "setuptools>=77" \
        "setuptools-rust==1.13.0" "semantic-version==2.10.0" >&2
    rm -f "$WHEELHOUSE"/.complete-* && touch "$stamp"
}

build_stage() (
    local recipe; recipe=$( (hash_of Dockerfile .dockerignore pyproject.toml constraints.txt README.md setup.py MANIFEST.in native/Cargo.toml native/Cargo.lock native/src schemas stage; image_id "$PYTHON_IMAGE"; echo "${WHEELHOUSE_INDEX:-} ${RUST_TOOLCHAIN-default}") | sha1sum | cut -c1-16)
    current "$STAGE_IMAGE" "$recipe" && return
    timed wheelhouse ""
    # A fixed port keeps the build argument, and so docker's cache of the dependency layer,
    # the same from one build to the next (a busy port costs that layer a rebuild).
    local port=${WHEELHOUSE_PORT:-38761}
    if ! "$PY" -c "import socket, sys; socket.create_server(('127.0.0.1', int(sys.argv[1])))" "$port" 2>/dev/null; then
        port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    fi
    "$PY" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" >/dev/null 2>&1 &
    local server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    # torch comes from the wheelhouse (pip gets --no-index); TORCH_INDEX_URL still names the
    # wheelhouse's index so the CPU and CUDA builds never share docker's dependency layer.
    # stage._native: the toolchain comes from rustup's server, the crates from crates.io. The test
    # images are built without it (RUST_TOOLCHAIN empty unless the environment sets one): a CI
    # machine reaches package registries, not necessarily rustup's server, and the contract's
    # Python loops give the same results. The released images set the Dockerfile's toolchain
    # (release_args).
    local rust=(--build-arg "RUST_TOOLCHAIN=${RUST_TOOLCHAIN-}")
    build "$STAGE_IMAGE" "$recipe" --build-arg "BASE_IMAGE=$PYTHON_IMAGE" --build-arg "TORCH_INDEX_URL=${WHEELHOUSE_INDEX:-}" \
        --build-arg "WHEELHOUSE_URL=http://127.0.0.1:$port/" "${rust[@]}" "$ROOT"
)

# The released images: the stage build above under the user-facing tag. A registry-less machine
# builds them on the local base from a wheelhouse like the test image; the CPU one's wheelhouse
# holds torch's +cpu wheel (its own directory), the CUDA one shares the test image's (PyPI's torch).
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml")
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu  # the Dockerfile's TORCH_INDEX_URL default
RELEASE_RUST=$(sed -n 's/^ARG RUST_TOOLCHAIN=//p' "$ROOT/Dockerfile")   # stage._native in released images
release_args() { # cpu|cuda -> the tag, then the variables the build gets, one per line
    local repo=${RELEASE_REPOSITORY:-rollout-reassembler}
    case $1 in
        cpu) echo "$repo:$VERSION"; echo "WHEELHOUSE=$WHEELHOUSE-cpu"; echo "WHEELHOUSE_INDEX=${TORCH_INDEX_URL-$CPU_TORCH_INDEX}"
             echo "TORCH_CUDA=no"; echo "RUST_TOOLCHAIN=${RUST_TOOLCHAIN-$RELEASE_RUST}" ;;
        cuda) echo "$repo:$VERSION-cuda"; echo "WHEELHOUSE=$WHEELHOUSE"; echo "WHEELHOUSE_INDEX="
              echo "TORCH_CUDA=yes"; echo "RUST_TOOLCHAIN=${RUST_TOOLCHAIN-$RELEASE_RUST}" ;;
        *) echo "usage: $0 release cpu|cuda" >&2; return 2 ;;
    esac
}

release() {
    local lines; lines=$(release_args "$1") || return 2
    local tag; tag=$(head -1 <<<"$lines")
    # shellcheck disable=SC2046  # one NAME=value per line, no spaces
    ( export $(tail -n +2 <<<"$lines"); STAGE_IMAGE=$tag
      timed build_base "$BASE_IMAGE"; timed build_python "$PYTHON_IMAGE"; timed build_stage "$tag"
      # An unreachable CPU index leaves pip on PyPI's torch (CUDA): refuse that image under the CPU tag.
      local cuda; cuda=$(docker run --rm --network none --entrypoint python "$tag" -c \
          'import torch; print("yes" if torch.version.cuda else "no")')
      [[ "$cuda" == "$TORCH_CUDA" ]] || { log "$tag: torch with CUDA: $cuda, wanted $TORCH_CUDA (TORCH_INDEX_URL?)"; exit 1; }
      log "built $tag (torch with CUDA: $cuda)" )
}

# Superseded builds (untagged, with this script's label) only: nothing else in the engine.
prune() { docker image prune --force --filter "label=$LABEL" >/dev/null; }

print_env() {
    local name var
    for pair in KAFKA_TEST_IMAGE:$KAFKA_IMAGE STAGE_TEST_IMAGE:$STAGE_IMAGE PROMETHEUS_TEST_IMAGE:$PROMETHEUS_IMAGE; do
        var=${pair%%:*} name=${pair#*:}
        docker image inspect "$name" >/dev/null 2>&1 && echo "export $var=$name"
    done
    true
}

case "${1:-all}" in
    base) timed build_base "$BASE_IMAGE" ;;
    kafka) timed build_base "$BASE_IMAGE"; timed build_kafka "$KAFKA_IMAGE" ;;
    python) timed build_base "$BASE_IMAGE"; timed build_python "$PYTHON_IMAGE" ;;
    stage) timed build_base "$BASE_IMAGE"; timed build_python "$PYTHON_IMAGE"; timed build_stage "$STAGE_IMAGE" ;;
    prometheus) timed build_base "$BASE_IMAGE"; timed build_prometheus "$PROMETHEUS_IMAGE" ;;
    all) timed build_base "$BASE_IMAGE"; timed build_kafka "$KAFKA_IMAGE"; timed build_python "$PYTHON_IMAGE"
         timed build_prometheus "$PROMETHEUS_IMAGE"; timed build_stage "$STAGE_IMAGE"; prune ;;
    release) release "${2:-}" ;;
    release-args) release_args "${2:-}" ;;
    env) print_env ;;
    *) echo "usage: $0 [base|kafka|python|prometheus|stage|all|release cpu|cuda|release-args cpu|cuda|env]" >&2; exit 2 ;;
esac
