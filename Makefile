# One entry point for developers and CI. `make test` installs what the tests need
# (idempotent: a stamp file keyed on pyproject.toml skips the install when nothing changed)
# and runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# keyed on the build's inputs: a change to the Rust extension (native/) reinstalls, which rebuilds it
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml setup.py native/Cargo.toml native/Cargo.lock native/src/*.rs | sha1sum | cut -c1-12)
# The compiled module stage._native (native/, setup.py) needs cargo; rustup puts it in
# ~/.cargo/bin, which a non-login shell may not have on PATH. Without cargo the install still
# succeeds (the extension is optional) and the tests fail under REQUIRE_NATIVE below.
CARGO_PATH := $(HOME)/.cargo/bin:$(PATH)
# The test targets fail if the extension is missing: CI proves the compiled path is the one run.
REQUIRE_NATIVE := ROLLOUT_REASSEMBLER_REQUIRE_NATIVE=1

KAFKA_LIB := .cache/kafka/lib

.PHONY: install native test test-unit test-jvm bench demo clean kafka-jars apicurio-registry helm ops-tools toxiproxy promtool prometheus-bin compose-cli images docker-up docker-down constraints \
  image image-cuda chart k8s test-k8s

# Ops tooling for tests/ops, built from the Go module proxy into the ignored .cache/bin (needs
# `go`; without it those tests skip). Idempotent: a stamp per version skips the build.
# helm: `helm lint --strict` / `helm template` of helm/rollout-reassembler. Built like helm's own
# Makefile does (its version and the Kubernetes version it assumes, from client-go v0.37 in
# helm v3.22.0's go.mod, are link-time settings; without them helm assumes Kubernetes 1.20).
HELM_VERSION   := v3.22.0
HELM_K8S_MINOR := 37
BIN            := .cache/bin
HELM           := $(BIN)/helm
HELM_STAMP     := $(BIN)/.helm-$(HELM_VERSION)-k8s1.$(HELM_K8S_MINOR)
HELM_LDFLAGS   := -s -w -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(HELM_K8S_MINOR) \
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(HELM_K8S_MINOR)
# promql-check (Prometheus's PromQL parser) and compose-spec (compose-go's loader: the Compose
# specification's JSON schema plus interpolation and consistency checks), pinned by tools/ops-check/go.sum.
OPS_STAMP      := $(BIN)/.ops-check-$(shell cat tools/ops-check/go.mod tools/ops-check/go.sum tools/ops-check/*/*.go 2>/dev/null | sha1sum | cut -c1-12)

install: $(STAMP)

$(STAMP): export PATH := $(CARGO_PATH)
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# pip's download cache (~/.cache/pip) keeps torch's multi-GB wheels across runs.
	$(PY) -m pip install --quiet --retries 10 --resume-retries 50 -e '.[test,demo]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Rebuild stage._native in place after editing native/ (what the editable install built; release
# profile). Without cargo it warns and leaves the Python loops in charge.
native: export PATH := $(CARGO_PATH)
native: install
	$(PY) setup.py build_ext --inplace

# A real Apache Kafka broker for the integration tests, from Maven Central (needs java + mvn;
# without them the broker-backed tests skip unless KAFKA_BOOTSTRAP_SERVERS is set).
kafka-jars: $(KAFKA_LIB)/.resolved

$(KAFKA_LIB)/.resolved: tools/kafka/pom.xml
	@if command -v mvn >/dev/null && command -v java >/dev/null; then \
	  rm -rf $(KAFKA_LIB) && \
	  mvn -q -f tools/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(abspath $(KAFKA_LIB)) \
	  && touch $@; \
	else echo "kafka-jars: no java/mvn here; real-broker tests will be skipped"; fi

# A real Schema Registry for the Schema Registry tests (tests/support/apicurio.py): Apicurio
# Registry's Quarkus distribution from Maven Central, unpacked into .cache/apicurio/<version>.
# Needs mvn; running it needs a Java >= 21 (the tests look in $APICURIO_JAVA, $JAVA_HOME, PATH
# and /usr/lib/jvm). Without them those tests skip, except under CI, where they fail.
APICURIO_VERSION := 3.3.3
APICURIO_DIR     := .cache/apicurio/$(APICURIO_VERSION)

apicurio-registry: $(APICURIO_DIR)/.resolved

$(APICURIO_DIR)/.resolved:
	@if command -v mvn >/dev/null; then \
	  tmp=$$(mktemp -d) \
	  && mvn -q dependency:copy -Dartifact=io.apicurio:apicurio-registry-app:$(APICURIO_VERSION):tar.gz:all \
	       -DoutputDirectory=$$tmp \
	  && rm -rf $(APICURIO_DIR) && mkdir -p $(APICURIO_DIR) \
	  && tar -xzf $$tmp/apicurio-registry-app-$(APICURIO_VERSION)-all.tar.gz -C $(APICURIO_DIR) \
	  && rm -rf $$tmp && touch $@; \
	else echo "apicurio-registry: no mvn here; the Schema Registry tests will be skipped (and fail under CI)"; fi

helm: $(HELM_STAMP)

$(HELM_STAMP):
	@mkdir -p $(BIN); if command -v go >/dev/null; then \
	  echo "building helm $(HELM_VERSION) into $(BIN) (Go module proxy; a few minutes the first time)"; \
	  GOBIN=$(abspath $(BIN)) CGO_ENABLED=0 GOFLAGS=-buildvcs=false go install -trimpath \
	    -ldflags '$(HELM_LDFLAGS)' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION) \
	  && rm -f $(BIN)/.helm-* && touch $@; \
	else echo "helm: no go toolchain here; the helm tests in tests/ops will be skipped"; fi

ops-tools: $(OPS_STAMP)

$(OPS_STAMP):
	@mkdir -p $(BIN); if command -v go >/dev/null; then \
	  cd tools/ops-check && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' \
	    -o $(abspath $(BIN))/promql-check ./promql-check \
	  && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' \
	    -o $(abspath $(BIN))/compose-spec github.com/compose-spec/compose-go/v2/cmd \
	  && cd $(CURDIR) && rm -f $(BIN)/.ops-check-* && touch $@; \
	else echo "ops-tools: no go toolchain here; PromQL and compose-go checks in tests/ops will be skipped"; fi

# Toxiproxy's server for the network fault suite (tests/faults/net/): a TCP proxy per broker
# whose faults (cut, latency, reset, bandwidth...) the tests set over its HTTP API. v2.5.0 is the
# newest version the Go module proxy serves for the /v2 module path (`go list -m -versions`).
TOXIPROXY_VERSION := v2.5.0
TOXIPROXY_STAMP   := $(BIN)/.toxiproxy-$(TOXIPROXY_VERSION)

toxiproxy: $(TOXIPROXY_STAMP)

$(TOXIPROXY_STAMP):
	@mkdir -p $(BIN); if command -v go >/dev/null; then \
	  echo "building toxiproxy-server $(TOXIPROXY_VERSION) into $(BIN) (Go module proxy)"; \
	  tmp=$$(mktemp -d) \
	  && GOBIN=$$tmp CGO_ENABLED=0 GOFLAGS=-buildvcs=false go install -trimpath -ldflags '-s -w' \
	       github.com/Shopify/toxiproxy/v2/cmd/server@$(TOXIPROXY_VERSION) \
	  && mv $$tmp/server $(BIN)/toxiproxy-server && rm -rf $$tmp \
	  && rm -f $(BIN)/.toxiproxy-* && touch $@; \
	else echo "toxiproxy: no go toolchain here; the network fault tests will be skipped (and fail under CI)"; fi

# promtool (`promtool test rules` on ops/prometheus/tests) and the Prometheus server of the
# compose stack's local image (no registry serves prom/prometheus here): both taken from
# Debian's `prometheus` package with `apt-get download` and unpacked into .cache/bin, not
# installed, because the package's postinst starts a Prometheus server. `apt-get update` runs
# only when the download fails (stale package lists; needs root).
PROMTOOL   := $(BIN)/promtool
PROMETHEUS := $(BIN)/prometheus

promtool prometheus-bin: $(PROMETHEUS)

$(PROMETHEUS):
	@mkdir -p $(BIN); if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then \
	  tmp=$$(mktemp -d) && cd $$tmp \
	  && { apt-get download -q prometheus 2>/dev/null || { apt-get update -qq && apt-get download -q prometheus; }; } \
	  && dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > $(abspath $(PROMTOOL)).tmp \
	  && dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/prometheus > $(abspath $@).tmp \
	  && cd $(CURDIR) && rm -rf $$tmp && chmod +x $(PROMTOOL).tmp $@.tmp \
	  && mv $(PROMTOOL).tmp $(PROMTOOL) && mv $@.tmp $@ && $(PROMTOOL) --version | head -1; \
	else echo "promtool: no apt-get/dpkg-deb here; the promtool tests in tests/ops fail under CI and skip elsewhere"; fi

# Docker Compose v2 for tests/docker's `compose up` (Debian's docker-compose is v1). Its go.mod
# has exclude directives, so `go install pkg@version` refuses it: the module is fetched from the
# Go module proxy and built as the main module.
COMPOSE_VERSION := v2.40.3
COMPOSE        := $(BIN)/docker-compose
COMPOSE_STAMP  := $(BIN)/.compose-$(COMPOSE_VERSION)

compose-cli: $(COMPOSE_STAMP)

$(COMPOSE_STAMP):
	@mkdir -p $(BIN); if command -v go >/dev/null; then \
	  echo "building docker compose $(COMPOSE_VERSION) into $(BIN) (Go module proxy; a few minutes the first time)"; \
	  src=$$(go mod download -json github.com/docker/compose/v2@$(COMPOSE_VERSION) | sed -n 's/.*"Dir": "\(.*\)",/\1/p') \
	  && tmp=$$(mktemp -d) && cp -r "$$src/." "$$tmp" && chmod -R u+w "$$tmp" \
	  && (cd "$$tmp" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath \
	       -ldflags '-s -w -X github.com/docker/compose/v2/internal.Version=$(COMPOSE_VERSION)' \
	       -o $(abspath $(COMPOSE)) ./cmd); rc=$$?; rm -rf "$$tmp"; \
	  [ $$rc = 0 ] && rm -f $(BIN)/.compose-* && touch $@; \
	else echo "compose-cli: no go toolchain here; the compose stack test will be skipped"; fi

# The images the docker tests run, built locally without a registry (tools/docker/images.sh:
# Debian base by debootstrap, Kafka from the Maven jars, Python base, the stage's Dockerfile).
images: install kafka-jars prometheus-bin
	bash tools/docker/images.sh all

# The images and chart a user takes (docs/operations.md, "Install from a registry"): built here,
# pushed nowhere. `make image`: rollout-reassembler:<pyproject version>, CPU torch; `make
# image-cuda`: the same tag with -cuda, PyPI's torch with the CUDA runtime (multi-GB). Both go
# through tools/docker/images.sh (local Debian base and a wheelhouse: no registry needed; needs a
# Docker engine, `make docker-up`), which checks the image's torch is the variant its tag says.
# RELEASE_REPOSITORY=registry.example.com/team/rollout-reassembler names them for a push.
VERSION       := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
CHART_DIR     := helm/rollout-reassembler
CHART_VERSION := $(shell sed -n 's/^version: *//p' $(CHART_DIR)/Chart.yaml)

image: install
	bash tools/docker/images.sh release cpu
image-cuda: install
	bash tools/docker/images.sh release cuda

# $(DIST)/rollout-reassembler-<Chart.yaml version>.tgz (`helm push` it to an OCI registry).
DIST ?= dist
chart:
	@h=$$(test -x $(HELM) && echo $(HELM) || command -v helm) \
	  || { echo "chart: no helm ($(HELM) or on PATH): run \`make helm\` (needs go)" >&2; exit 1; }; \
	  mkdir -p $(DIST) && $$h package $(CHART_DIR) --destination $(DIST) \
	  && test -f $(DIST)/rollout-reassembler-$(CHART_VERSION).tgz

# A real Kubernetes control plane for tests/k8s (tools/k8s/build.sh): kube-apiserver,
# kube-controller-manager, kube-scheduler $(K8S_VERSION) and kwok built from the Go module proxy,
# etcd from Debian's package, into .cache/k8s/<version>/ (cached by version). Cold: ~25 min on a
# loaded 2-core machine, so CI does not build it; `make test-k8s` (and `make test`) then skip
# tests/k8s, naming this target. test-k8s starts the control plane on 127.0.0.1 and stops it.
K8S_VERSION := 1.34.2

k8s: helm
	K8S_VERSION=$(K8S_VERSION) nice -n 19 bash tools/k8s/build.sh

test-k8s: install helm
	K8S_VERSION=$(K8S_VERSION) $(PY) -m pytest -q -p no:cacheprovider tests/k8s

# A Docker engine for the tests (tools/docker/engine.sh): the running one, or Debian's docker.io
# started with no bridge; docker-down stops only a daemon that docker-up started.
docker-up:
	bash tools/docker/engine.sh up
docker-down:
	bash tools/docker/engine.sh down

# Re-resolve constraints.txt, the stage image's pinned dependencies (uv, the `lock` extra).
constraints: install
	$(PY) -m pip install --quiet -e '.[lock]'
	$(VENV)/bin/uv pip compile pyproject.toml --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --upgrade -o constraints.txt

# Integration and fault suites on a dockerized broker where an engine can run (tools/docker/
# engine.sh brings it up, builds the local images, and stops what it started); else on the JVM
# broker. KAFKA_TEST_BROKER=jvm skips Docker entirely.
test: install kafka-jars apicurio-registry helm ops-tools toxiproxy promtool compose-cli
	$(REQUIRE_NATIVE) bash tools/docker/engine.sh run -- $(PY) -m pytest -q

# The light paths (README, Test): what needs no broker and is not slow (fuzz, benchmark
# commands: tests/conftest.py marks them), in a few minutes; then the whole suite
# on the JVM broker from the Maven jars, without Docker (no engine installed or started).
test-unit: install
	$(REQUIRE_NATIVE) KAFKA_TEST_BROKER=none $(PY) -m pytest -q -m "not broker and not slow" -p no:cacheprovider

test-jvm: install kafka-jars apicurio-registry helm ops-tools toxiproxy promtool
	$(REQUIRE_NATIVE) KAFKA_TEST_BROKER=jvm DOCKER_SETUP=off $(PY) -m pytest -q

bench: install
	$(VENV)/bin/rollout-reassembler bench verify

# The main job on one machine: embedded broker, synthetic workload with faults, the stage, the
# trainer-side reader, every output checked. DEMO_ARGS passes options (`demo --help`).
demo: install
	$(VENV)/bin/rollout-reassembler demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info native/target stage/_native*.so
