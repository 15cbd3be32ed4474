#!/usr/bin/env bash
# Builds a Kubernetes control plane for tests/k8s into .cache/k8s/<version>/ (`make k8s`), cached
# by version: kube-apiserver, kube-controller-manager and kube-scheduler from the Go module proxy,
# kwok (fake nodes), etcd unpacked from Debian's etcd-server package (not installed: nothing is
# started), and the KEDA / Prometheus Operator CRDs the chart's optional objects need.
# Cold: ~25 min on a loaded 2-core machine (kube-apiserver is most of it); warm: a no-op.
# Adapted from the recipe in ../shared/k8s (README there). Needs go, apt-get + dpkg-deb.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
K8S_VERSION=${K8S_VERSION:-1.34.2}
KWOK_VERSION=${KWOK_VERSION:-v0.7.0}
KEDA_VERSION=${KEDA_VERSION:-v2.18.3}
PROMOP_VERSION=${PROMOP_VERSION:-v0.85.0}
OUT=${K8S_CACHE:-$ROOT/.cache/k8s}/$K8S_VERSION
SRC=$OUT/src
NICE=${NICE:-nice -n 19}
export GOFLAGS=${GOFLAGS:--buildvcs=false}
COMPONENTS="kube-apiserver kube-controller-manager kube-scheduler"
log() { printf 'k8s: %s\n' "$*" >&2; }
command -v go >/dev/null || { log "needs a Go toolchain (go)"; exit 1; }
mkdir -p "$OUT/bin" "$OUT/crds"

mod_dir() { go mod download -json "$1" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p'; }

build_k8s() {
  local minor=${K8S_VERSION#1.}; minor=${minor%%.*}
  mkdir -p "$SRC"
  if [ ! -f "$SRC/go.sum" ]; then
    local moddir; moddir=$(mod_dir "k8s.io/kubernetes@v$K8S_VERSION")
    # k8s.io/kubernetes' go.mod replaces k8s.io/* with ./staging/..., which its module zip lacks:
    # a wrapper main module replaces each with the published v0.<minor>.<patch> release instead.
    { echo "module kbuild"; echo; echo "go 1.24.0"; echo; echo "require k8s.io/kubernetes v$K8S_VERSION"; echo
      echo "replace ("
      for m in $(sed -n '/^replace (/,/^)/p' "$moddir/go.mod" | awk '/=>/{print $1}'); do
        echo "	$m => $m v0.${K8S_VERSION#1.}"; done
      echo ")"; } > "$SRC/go.mod"
    printf '//go:build tools\n\npackage kbuild\n\nimport (\n' > "$SRC/tools.go"
    for b in $COMPONENTS; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$b" >> "$SRC/tools.go"; done
    printf ')\n' >> "$SRC/tools.go"
    (cd "$SRC" && $NICE go mod tidy)
  fi
  # Without the version link flags /version says v0.0.0-master and the chart's kubeVersion refuses it.
  local V=k8s.io/component-base/version
  local ld="-s -w -X $V.gitVersion=v$K8S_VERSION -X $V.gitMajor=1 -X $V.gitMinor=$minor"
  ld="$ld -X $V.gitTreeState=clean -X $V.buildDate=1970-01-01T00:00:00Z"
  ld="$ld -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION"
  for b in $COMPONENTS; do
    [ -x "$OUT/bin/$b" ] && continue
    local t0=$SECONDS
    log "building $b v$K8S_VERSION"
    (cd "$SRC" && $NICE go build -trimpath -ldflags "$ld" -o "$OUT/bin/$b.tmp" "k8s.io/kubernetes/cmd/$b")
    mv "$OUT/bin/$b.tmp" "$OUT/bin/$b"
    log "built $b in $((SECONDS - t0)) s"
  done
}

build_kwok() {
  [ -x "$OUT/bin/kwok" ] && return 0
  local t0=$SECONDS tmp; tmp=$(mktemp -d)
  GOBIN=$tmp CGO_ENABLED=0 $NICE go install -trimpath -ldflags '-s -w' "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  mv "$tmp/kwok" "$OUT/bin/kwok"; rm -rf "$tmp"
  log "built kwok $KWOK_VERSION in $((SECONDS - t0)) s"
}

unpack_etcd() {
  [ -x "$OUT/bin/etcd" ] && return 0
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && { apt-get download -q etcd-server >/dev/null 2>&1 \
     || { apt-get update -qq && apt-get download -q etcd-server >/dev/null; }; } \
   && dpkg-deb -x etcd-server_*.deb x)
  cp "$tmp/x/usr/bin/etcd" "$OUT/bin/etcd"; rm -rf "$tmp"
  log "etcd: $("$OUT/bin/etcd" --version | head -1)"
}

fetch_crds() {
  local kd pd
  kd=$(mod_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
  pd=$(mod_dir "github.com/prometheus-operator/prometheus-operator@$PROMOP_VERSION")
  cp "$kd"/config/crd/bases/keda.sh_*.yaml "$OUT/crds/"
  cp "$pd"/example/prometheus-operator-crd/monitoring.coreos.com_{servicemonitors,prometheusrules}.yaml "$OUT/crds/"
  chmod u+w "$OUT"/crds/*.yaml
}

T0=$SECONDS
unpack_etcd
fetch_crds
build_k8s
build_kwok
# The stamp the tests look for: every binary is there and runs.
for b in etcd $COMPONENTS kwok; do "$OUT/bin/$b" --version >/dev/null 2>&1 || "$OUT/bin/$b" --help >/dev/null 2>&1 \
  || { log "$b does not run"; exit 1; }; done
printf 'k8s=%s kwok=%s keda=%s prometheus-operator=%s\n' "$K8S_VERSION" "$KWOK_VERSION" "$KEDA_VERSION" "$PROMOP_VERSION" > "$OUT/.complete"
log "ready in $OUT ($((SECONDS - T0)) s)"
