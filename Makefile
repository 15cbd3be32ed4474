# One entry point for developers and CI. `make test` installs what the tests need
# (idempotent: a stamp file keyed on pyproject.toml skips the install when nothing changed)
# and runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: install test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# pip's download cache (~/.cache/pip) keeps torch's multi-GB wheels across runs.
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/rollout-reassembler bench verify

clean:
	rm -rf $(VENV) build *.egg-info
