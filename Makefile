# Set-up shared by the two README commands. Every step is idempotent and cheap when already done:
# Debian packages are checked with dpkg, the rest is guarded by stamp files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TOOLS_BIN := .tools/bin
FAKE_GCS_SERVER_VERSION := v1.52.2
APT_PACKAGES := libaio-dev redis-server redis-tools fio
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup apt-packages test lint bench clean

## setup: everything the tests and benchmarks need (safe to run again: under 15 s when done)
setup: apt-packages $(VENV)/.installed $(TOOLS_BIN)/fake-gcs-server-$(FAKE_GCS_SERVER_VERSION) $(VENV)/.async-io-built

apt-packages:
	@missing=$$(for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo ">> installing Debian packages:" $$missing; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(VENV)/.installed: setup.cfg pyproject.toml | $(VENV)/bin/python
	@echo ">> installing the package (editable) with its test extra into $(VENV)"
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

$(TOOLS_BIN)/fake-gcs-server-$(FAKE_GCS_SERVER_VERSION):
	@command -v go >/dev/null || { echo "Go is needed to build fake-gcs-server: install golang" >&2; exit 1; }
	@echo ">> building fake-gcs-server $(FAKE_GCS_SERVER_VERSION) into $(TOOLS_BIN) (about 3 minutes)"
	@mkdir -p $(TOOLS_BIN)
	GOBIN=$(abspath $(TOOLS_BIN)) go install github.com/fsouza/fake-gcs-server@$(FAKE_GCS_SERVER_VERSION)
	@touch $@

$(VENV)/.async-io-built: $(VENV)/.installed | apt-packages
	@echo ">> building DeepSpeed's async_io op once (JIT compile, 4-5 minutes on 2 cores)"
	$(PY) -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
	@touch $@

## test: set up, lint, run the whole suite
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

## bench: set up, run the main job (python -m benchmarks.lightning_ckpt on its embedded default)
bench: setup
	$(PY) -m benchmarks.lightning_ckpt $(ARGS)

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis
