# One entry point for developers and CI. `make test` installs what the tests need
# (idempotent: a stamp file keyed on pyproject.toml skips the install when nothing changed)
# and runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

KAFKA_LIB := .cache/kafka/lib

.PHONY: install test bench clean kafka-jars

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# pip's download cache (~/.cache/pip) keeps torch's multi-GB wheels across runs.
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# A real Apache Kafka broker for the integration tests, from Maven Central (needs java + mvn;
# without them the broker-backed tests skip unless KAFKA_BOOTSTRAP_SERVERS is set).
kafka-jars: $(KAFKA_LIB)/.resolved

$(KAFKA_LIB)/.resolved: tools/kafka/pom.xml
	@if command -v mvn >/dev/null && command -v java >/dev/null; then \
	  mvn -q -f tools/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(abspath $(KAFKA_LIB)) \
	  && touch $@; \
	else echo "kafka-jars: no java/mvn here; real-broker tests will be skipped"; fi

test: install kafka-jars
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/rollout-reassembler bench verify

clean:
	rm -rf $(VENV) build *.egg-info
