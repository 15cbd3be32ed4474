#!/usr/bin/env bash
# A real Kubernetes control plane on 127.0.0.1 for tests/k8s, from the binaries `make k8s` caches
# (tools/k8s/build.sh): etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake
# nodes: the real StatefulSet controller creates the pods, the real scheduler places them, kwok
# marks them Running and Ready; no kubelet, so no container ever runs). No containers, no network
# set-up: every process listens on 127.0.0.1 only; the Service and pod ranges are values stored in
# etcd, taken from 198.18.0.0/15 (benchmarking, not a private range).
#   cluster.sh up STATE_DIR     starts everything (ports from ETCD_PORT, ETCD_PEER_PORT, API_PORT),
#                               waits for /readyz, writes STATE_DIR/kubeconfig
#   cluster.sh down STATE_DIR   stops what `up` started in STATE_DIR (by its recorded pids)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
K8S_VERSION=${K8S_VERSION:-1.34.2}
BIN=${K8S_BIN:-${K8S_CACHE:-$ROOT/.cache/k8s}/$K8S_VERSION/bin}
CMD=${1:?usage: cluster.sh up|down STATE_DIR}
STATE=${2:?usage: cluster.sh up|down STATE_DIR}
SERVICE_CIDR=198.18.0.0/24
POD_CIDR=198.18.1.0/24
PKI=$STATE/pki RUN=$STATE/run LOG=$STATE/logs
log() { printf 'k8s cluster: %s\n' "$*" >&2; }

running() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

down() {
  for n in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
    running "$n" || { rm -f "$RUN/$n.pid"; continue; }
    local pid; pid=$(cat "$RUN/$n.pid")
    kill "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$RUN/$n.pid"
  done
}

pki() {
  mkdir -p "$PKI"; cd "$PKI"
  [ -f admin.crt ] && return 0
  local first_ip; first_ip=198.18.0.1  # the `kubernetes` Service's ClusterIP: first of SERVICE_CIDR
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 -subj /CN=test-k8s-ca 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' \
    "$first_ip" > apiserver.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile apiserver.ext -out apiserver.crt 2>/dev/null
  # The admin client (helm, the tests, controller-manager, scheduler, kwok): O=system:masters.
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj /O=system:masters/CN=kubernetes-admin 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile client.ext -out admin.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cd - >/dev/null
}

start() { # name cmd...
  local n=$1; shift
  running "$n" && return 0
  setsid "$@" >"$LOG/$n.log" 2>&1 </dev/null &
  echo $! > "$RUN/$n.pid"
}

wait_for() { # what seconds cmd...
  local what=$1 t=$2; shift 2
  for _ in $(seq "$t"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  log "timeout waiting for $what; its log:"; tail -20 "$LOG/$what.log" >&2; return 1
}

up() {
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
    [ -x "$BIN/$b" ] || { log "no $BIN/$b: run \`make k8s\`"; exit 1; }
  done
  : "${ETCD_PORT:?}" "${ETCD_PEER_PORT:?}" "${API_PORT:?}"
  mkdir -p "$RUN" "$LOG" "$STATE/data"
  pki
  local kc=$STATE/kubeconfig
  cat > "$kc" <<EOK
apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: $PKI/ca.crt}
users:
- name: admin
  user: {client-certificate: $PKI/admin.crt, client-key: $PKI/admin.key}
contexts:
- name: test
  context: {cluster: test, user: admin, namespace: default}
current-context: test
EOK
  chmod 600 "$kc"
  start etcd "$BIN/etcd" --name test --data-dir "$STATE/data/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "test=http://127.0.0.1:$ETCD_PEER_PORT" --quota-backend-bytes 536870912
  wait_for etcd 60 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
  # WatchList off: streamed lists need etcd's RequestWatchProgress, which Debian's etcd 3.4 lacks;
  # the API server then ends every such watch with an error and kwok's informers only catch up
  # on their re-lists, tens of seconds late (a StatefulSet rollout outlived helm's 180 s --wait).
  # Off, the clients use plain LIST + WATCH.
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --endpoint-reconciler-type none \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" --client-ca-file "$PKI/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$PKI/sa.pub" \
    --service-account-signing-key-file "$PKI/sa.key" --service-cluster-ip-range "$SERVICE_CIDR" \
    --authorization-mode Node,RBAC --cert-dir "$STATE/data/apiserver-certs" --feature-gates WatchList=false
  wait_for kube-apiserver 240 curl -fsS --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz"
  local client=(--kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc"
                --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false)
  start kube-controller-manager "$BIN/kube-controller-manager" "${client[@]}" \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --use-service-account-credentials=true \
    --controllers '*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller'
  start kube-scheduler "$BIN/kube-scheduler" "${client[@]}"
  # kwok manages only nodes annotated kwok.x-k8s.io/node=fake (the tests create them).
  start kwok "$BIN/kwok" --kubeconfig "$kc" --server-address "" --node-port 0 \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-ip 127.0.0.1 --cidr "$POD_CIDR" --node-lease-duration-seconds 40
  sleep 1
  for n in kube-controller-manager kube-scheduler kwok; do
    running "$n" || { log "$n exited; its log:"; tail -20 "$LOG/$n.log" >&2; down; exit 1; }
  done
  echo "$kc"
}

case $CMD in
  up) up ;;
  down) down ;;
  *) echo "usage: cluster.sh up|down STATE_DIR" >&2; exit 2 ;;
esac
