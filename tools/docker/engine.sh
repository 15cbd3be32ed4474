#!/usr/bin/env bash
# The Docker engine for the tests (README, "Install and test"):
#   engine.sh run -- CMD...   engine up, local images built, CMD run with their variables, then
#                             down; exits with CMD's status
#   engine.sh up | down       the same steps by hand
# up: an engine that already answers `docker info` is used as it is (a laptop). Otherwise, as
# root with apt (a fresh CI machine), Debian's docker.io and debootstrap are installed and dockerd
# is started with no bridge and no iptables rules (containers use the host network; nothing
# else can be created); its pid is recorded so that `down` stops only a daemon started here.
# DOCKER_SETUP=off skips all of it; without an engine the tests use the JVM broker.
# Local images (images.sh: no registry needed) are built where debootstrap can run (root), or
# with DOCKER_LOCAL_IMAGES=on; DOCKER_LOCAL_IMAGES=off leaves the tests on registry images
# (apache/kafka) as on a laptop.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STATE=${ROLLOUT_REASSEMBLER_DOCKER_STATE:-/run/rollout-reassembler}
PIDFILE=$STATE/dockerd.pid
LOG=$STATE/dockerd.log
TEST_LABEL=org.rollout-reassembler.test

say() { printf 'docker engine: %s\n' "$*" >&2; }
answers() { command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; }

install_engine() {
    command -v dockerd >/dev/null && command -v debootstrap >/dev/null && return 0
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || { say "no dockerd, and not root with apt"; return 1; }
    say "installing Debian's docker.io and debootstrap"
    local start=$SECONDS
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io debootstrap; } >"$STATE/apt.log" 2>&1 || { tail -20 "$STATE/apt.log" >&2; return 1; }
    say "installed in $((SECONDS - start)) s"
}

up() {
    answers && { say "using the running engine"; return 0; }
    [[ "${DOCKER_SETUP:-auto}" == off ]] && { say "DOCKER_SETUP=off"; return 1; }
    mkdir -p "$STATE"
    install_engine || return 1
    local start=$SECONDS
    # --bridge=none: no docker0 and no network on a private range; --iptables/--ip-masq off:
    # the host's firewall is left alone. Images and layers persist in /var/lib/docker.
    setsid dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
        --storage-driver=overlay2 >"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 60); do answers && { say "dockerd started in $((SECONDS - start)) s (pid $(cat "$PIDFILE"))"; return 0; }; sleep 0.5; done
    say "dockerd did not answer; its log:"; tail -20 "$LOG" >&2
    down; return 1
}

down() {
    if answers; then
        # leftovers of a killed test run: only containers the tests labelled
        local left; left=$(docker ps -aq --filter "label=$TEST_LABEL")
        [[ -n "$left" ]] && docker rm --force --volumes $left >/dev/null
    fi
    [[ -f "$PIDFILE" ]] || return 0
    local pid; pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        say "dockerd (pid $pid) stopped"
    fi
    rm -f "$PIDFILE"
}

local_images() {
    case "${DOCKER_LOCAL_IMAGES:-auto}" in
        on) return 0 ;;
        off) return 1 ;;
        *) [[ $(id -u) == 0 ]] && command -v debootstrap >/dev/null ;;
    esac
}

run() {
    local engine=0 rc
    if [[ "${KAFKA_TEST_BROKER:-auto}" != jvm ]] && up; then
        engine=1
        if local_images; then
            # An engine that runs but cannot build the images is a failure, not a reason to skip.
            bash "$ROOT/tools/docker/images.sh" all || { down; return 1; }
        fi
        eval "$(bash "$ROOT/tools/docker/images.sh" env)"
    fi
    "$@"; rc=$?
    [[ $engine == 1 ]] && down
    return $rc
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    run) shift; [[ "${1:-}" == -- ]] && shift; run "$@" ;;
    *) echo "usage: $0 up | down | run -- CMD..." >&2; exit 2 ;;
esac
