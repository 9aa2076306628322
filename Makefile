# The checkout's set-up and the README's commands. Every step is idempotent and cheap when done:
# Debian packages are checked with dpkg, the rest is guarded by stamp files.
#
#   make setup   the three environments, the service binaries and DeepSpeed's async_io op
#   make test    lint, the whole suite on the newest releases, then the oldest-supported and middle subsets,
#                then the recovery tests (make test-recovery)
#   make bench   the main job: python -m benchmarks.lightning_ckpt
#   make module  the smartredis_io Redis module (part of setup)
SHELL := /bin/bash
PYTHON ?= python3
# The oldest supported Python for the oldest-supported environment, where pyenv has it.
PYTHON_OLDEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3) $(PYTHON))
PYTHON_MIDDLE ?= $(PYTHON)
VENV := .venv
VENV_OLDEST := .venv-oldest
VENV_MIDDLE := .venv-middle
PY := $(VENV)/bin/python
PY_OLDEST := $(VENV_OLDEST)/bin/python
PY_MIDDLE := $(VENV_MIDDLE)/bin/python
TOOLS_BIN := .tools/bin
FAKE_GCS_SERVER_VERSION := v1.52.2
TOXIPROXY_VERSION := v2.12.0
# The published Dataflux package, the main job's peer row: it needs google-cloud-storage 2.x, which
# cannot share an environment with ours (3.x), so it lives in its own directory for the peer's worker
# (pinned in benchmarks/lightning_peer.py, which also finds it there).
PEER_DIR := .tools/gcs-torch-dataflux
# Slurm, with munge and accounting (slurmdbd on MariaDB), for the tests' private cluster
# (tests/support/slurm.py starts every daemon itself, in its own directory: their system services,
# which the packages may start, are never used)
APT_PACKAGES := libaio-dev redis-server redis-tools fio openmpi-bin libopenmpi-dev \
	slurm-wlm munge slurmdbd mariadb-server
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# The oldest releases we support, tested in their own environment: FastPersist's validated torch and
# the Lightning and DeepSpeed releases of its time.
OLDEST_PINS := torch==2.6.0 lightning==2.5.0.post0 pytorch-lightning==2.5.0.post0 deepspeed==0.16.4
# What the oldest environment runs: everything of fastpersist, the Lightning plugins of all three, and
# smartredis_io's own client, wire and module paths under numpy 2 (the published client there is absent).
OLDEST_TESTS := tests/fastpersist tests/test_fast_paths.py tests/test_checkpoint_io.py tests/lightning_storage_plugins/test_ordering.py tests/lightning_storage_plugins/test_collector.py tests/lightning_storage_plugins/test_release.py tests/dataflux_ckpt/test_trainer.py \
	tests/lightning_storage_plugins/test_resume_last.py tests/lightning_storage_plugins/test_reentrant_saves.py \
	tests/lightning_storage_plugins/test_torch_compat.py tests/dataflux_ckpt/test_load_views.py tests/dataflux_ckpt/test_checksums.py \
	tests/dcp/test_storage.py tests/dcp/test_ranks.py tests/dcp/test_lightning.py tests/dcp/test_deepspeed.py \
	tests/dcp/test_sharded_reentry.py tests/dcp/test_requeue_signal.py tests/dcp/test_restart_cleanup.py \
	tests/smartredis_io/test_lightning.py \
	tests/smartredis_io/test_client.py tests/smartredis_io/test_fast_paths.py tests/smartredis_io/test_dataset.py \
	tests/smartredis_io/test_redis_module.py
# A release between the oldest and the newest, in its own environment: the fast save and load paths are
# chosen by what the installed torch does, and this is a torch whose sources differ from both ends'.
MIDDLE_PINS := torch==2.11.0 lightning==2.6.1 pytorch-lightning==2.6.1 deepspeed==0.18.9
# What the middle environment runs: fastpersist, the DCP storages, and the GCS loads.
MIDDLE_TESTS := tests/fastpersist tests/test_fast_paths.py tests/lightning_storage_plugins/test_torch_compat.py \
	tests/dcp/test_storage.py tests/dataflux_ckpt/test_load_views.py tests/dataflux_ckpt/test_checksums.py \
	tests/test_checkpoint_io.py
# Run in the newest environment only, as they exercise our code the same way on every torch: FastPersist's
# example scripts and benchmark runner (drivers of the save and load paths tested beside them), the
# GCS load's memory bound, and (in the oldest) the 4-2-1-2 resharding chain, where torch's planner
# reshards over the same storage calls that the 2-rank killed-rank test makes there. About three
# minutes less across the other two environments.
OLDER_ENV_DESELECT := $(addprefix --deselect=tests/fastpersist/test_examples_and_benchmark.py::,\
	test_store_then_load_scripts_report_throughput_and_validate test_gpu_and_gds_scripts_refuse_cleanly_without_cuda \
	test_benchmark_tensor_workload_on_tiny_sizes test_benchmark_deepspeed_workload_compares_durable_with_durable) \
	--deselect=tests/dataflux_ckpt/test_load_views.py::test_a_load_holds_about_one_checkpoint_of_extra_memory
# In the newest only too, as the oldest runs a variant that takes the same Lightning and torch calls: the
# killed two-rank save's restart on gs:// (its nvme twin runs there), a signal that reaches one rank alone
# (its every-rank twin runs there), and SmartRedis keys of local paths (Lightning's own path handling runs
# there in the redis:// dirpath and ckpt_path="last" test). About three minutes less on a slow day.
OLDEST_DESELECT := $(OLDER_ENV_DESELECT) --deselect=tests/dcp/test_ranks.py::test_reshard_4_to_2_to_1_to_2 \
	--deselect='tests/dcp/test_restart_cleanup.py::test_a_restart_removes_what_a_killed_sharded_save_left_and_keeps_a_live_save[gs-fsdp]' \
	--deselect=tests/dcp/test_requeue_signal.py::test_a_signal_that_reaches_one_rank_alone_ends_the_run_within_the_collectives_timeout \
	--deselect=tests/smartredis_io/test_lightning.py::test_local_paths_are_keyed_relative_to_the_root_dir
# Hopper images set entries such as 9.0a, which DeepSpeed's op builder cannot parse: the op build
# gets the list fastpersist gives DeepSpeed at run time (one rule: _deepspeed_compat.sanitized_arch_list).
# $(call ARCH_LIST,python): the environment assignment for that python's op build, empty when unset.
ARCH_LIST = $(if $(TORCH_CUDA_ARCH_LIST),TORCH_CUDA_ARCH_LIST="$$($(1) -c 'import sys; from fastpersist._deepspeed_compat import sanitized_arch_list; print(sanitized_arch_list(sys.argv[1]))' '$(TORCH_CUDA_ARCH_LIST)')")
# The smartredis_io Redis module, built in place (an editable install finds it; wheels build their own),
# and its AddressSanitizer + UndefinedBehaviorSanitizer build for the tests, in .tools/sanitize. Its
# header, redismodule.h, is in the repository (pinned, SHA-256 checked): nothing is downloaded.
MODULE_DIR := smartredis_io/redisai
MODULE := $(MODULE_DIR)/srio_redisai.so
export FAKE_GCS_SERVER_BIN ?= $(abspath $(TOOLS_BIN))/fake-gcs-server
export TOXIPROXY_SERVER_BIN ?= $(abspath $(TOOLS_BIN))/toxiproxy-server

.PHONY: setup setup-newest setup-oldest setup-middle apt-packages tools module test test-newest test-oldest test-middle test-recovery test-newest-a test-newest-b test-older-and-recovery lint bench clean

## setup: everything the tests and benchmarks need (safe to run again: seconds when done). The three
## environments are set up side by side: one's op build (CPU) runs while the next one downloads.
setup:
	$(MAKE) -j3 --output-sync=line setup-newest setup-oldest setup-middle

setup-newest: apt-packages tools module $(VENV)/.installed $(VENV)/.async-io-built $(PEER_DIR)/.installed $(VENV)/.smartsim-installed
setup-oldest: apt-packages tools module $(VENV_OLDEST)/.installed $(VENV_OLDEST)/.async-io-built
setup-middle: apt-packages tools module $(VENV_MIDDLE)/.installed $(VENV_MIDDLE)/.async-io-built
tools: $(TOOLS_BIN)/fake-gcs-server-$(FAKE_GCS_SERVER_VERSION) $(TOOLS_BIN)/toxiproxy-$(TOXIPROXY_VERSION)

apt-packages:
	@missing=$$(for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo ">> installing Debian packages:" $$missing; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# cc -O2 -Werror, then cc -fsanitize=address,undefined: a few seconds each; build.py skips a build
# whose sources and compiler command ($$CC, $$CFLAGS) are unchanged; any Python 3 runs it. --python
# records the checkout's environment as the interpreter of the module's workers (this checkout's
# module sits in no site-packages directory, where they would find theirs).
module:
	$(PYTHON) $(MODULE_DIR)/build.py --python $(abspath $(PY))
	$(PYTHON) $(MODULE_DIR)/build.py --sanitize --python $(abspath $(PY))

# An editable install writes the checkout's own .egg-info and build/: the environments, set up side by
# side, take turns for it (their op builds and other installs still overlap), and one that has to wait says so.
EDITABLE_LOCK = build/.editable-install.lock
EDITABLE_INSTALL = mkdir -p build && { flock -n $(EDITABLE_LOCK) true || \
	echo ">> waiting for another environment's editable install of this checkout ($(EDITABLE_LOCK))"; } && \
	flock $(EDITABLE_LOCK)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(VENV)/.installed: setup.cfg pyproject.toml | $(VENV)/bin/python apt-packages
	@echo ">> installing the package (editable) with its test and mpi extras into $(VENV)"
	$(EDITABLE_INSTALL) $(PY) -m pip install -q -e '.[test,mpi]'
	@touch $@

$(VENV_OLDEST)/bin/python:
	$(PYTHON_OLDEST) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip setuptools wheel

$(VENV_OLDEST)/.installed: setup.cfg pyproject.toml Makefile | $(VENV_OLDEST)/bin/python apt-packages
	@echo ">> installing the oldest supported releases ($(OLDEST_PINS)) into $(VENV_OLDEST) ($$($(PY_OLDEST) -V))"
	$(EDITABLE_INSTALL) $(PY_OLDEST) -m pip install -q -e '.[all]' $(OLDEST_PINS) 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'psutil>=5.9'
	@touch $@

$(VENV_MIDDLE)/bin/python:
	$(PYTHON_MIDDLE) -m venv $(VENV_MIDDLE)
	$(PY_MIDDLE) -m pip install -q --upgrade pip setuptools wheel

$(VENV_MIDDLE)/.installed: setup.cfg pyproject.toml Makefile | $(VENV_MIDDLE)/bin/python apt-packages
	@echo ">> installing the middle releases ($(MIDDLE_PINS)) into $(VENV_MIDDLE) ($$($(PY_MIDDLE) -V))"
	$(EDITABLE_INSTALL) $(PY_MIDDLE) -m pip install -q -e '.[all]' $(MIDDLE_PINS) 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'psutil>=5.9'
	@touch $@

$(TOOLS_BIN)/fake-gcs-server-$(FAKE_GCS_SERVER_VERSION):
	@command -v go >/dev/null || { echo "Go is needed to build fake-gcs-server: install golang" >&2; exit 1; }
	@echo ">> building fake-gcs-server $(FAKE_GCS_SERVER_VERSION) into $(TOOLS_BIN) (about 3 minutes)"
	@mkdir -p $(TOOLS_BIN)
	GOBIN=$(abspath $(TOOLS_BIN)) go install github.com/fsouza/fake-gcs-server@$(FAKE_GCS_SERVER_VERSION)
	@touch $@

$(TOOLS_BIN)/toxiproxy-$(TOXIPROXY_VERSION):
	@command -v go >/dev/null || { echo "Go is needed to build toxiproxy: install golang" >&2; exit 1; }
	@echo ">> building toxiproxy $(TOXIPROXY_VERSION) into $(TOOLS_BIN)"
	@mkdir -p $(TOOLS_BIN)
	GOBIN=$(abspath $(TOOLS_BIN)) go install github.com/Shopify/toxiproxy/v2/cmd/server@$(TOXIPROXY_VERSION)
	mv -f $(TOOLS_BIN)/server $(TOOLS_BIN)/toxiproxy-server
	@touch $@

$(PEER_DIR)/.installed: benchmarks/lightning_peer.py | $(VENV)/.installed
	@echo ">> installing the peer package into $(PEER_DIR)"
	$(PY) -m pip install -q --no-deps --upgrade --target $(PEER_DIR) \
		$$($(PY) -c "from benchmarks.lightning_peer import PEER_PINS; print(*PEER_PINS)")
	@touch $@

# SmartSim, for the tests that run its Experiments on the Redis module (its wheels, like smartredis's,
# stop at Python 3.11). It cannot be an extra: it pins protobuf<=3.20.3, which it imports only for
# TensorFlow, while google-api-core 2.44 (google-cloud-storage 3, gcsfs) needs protobuf>=6.33.5, and
# pip's resolver backtracks without end between the two. So it is installed without its dependencies,
# then each of them but protobuf, as its metadata lists them.
SMARTSIM_PIN := smartsim==0.8.0
SMARTSIM_DEPS = $(PY) -c 'import importlib.metadata as m; from packaging.requirements import Requirement; \
	rs = [Requirement(r) for r in m.requires("smartsim")]; \
	print(*(f"{r.name}{r.specifier}" for r in rs if r.name != "protobuf" and (r.marker is None or r.marker.evaluate({"extra": ""}))))'
$(VENV)/.smartsim-installed: | $(VENV)/.installed
	@if $(PY) -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then \
		echo ">> installing $(SMARTSIM_PIN) (without protobuf) into $(VENV)"; \
		$(PY) -m pip install -q --no-deps $(SMARTSIM_PIN) && $(PY) -m pip install -q $$($(SMARTSIM_DEPS)); \
	fi
	@touch $@

# DeepSpeed's async_io op, compiled once per environment into a directory of that environment
# (fastpersist.build_ops), never at run time: torch's shared JIT cache is keyed by Python and CUDA
# version only, so environments (or one venv reached through two paths) would recompile each other's.
# (after SmartSim's installs, which may change packages of the environment the build imports)
$(VENV)/.async-io-built: $(VENV)/.installed fastpersist/build_ops.py | apt-packages $(VENV)/.smartsim-installed
	@echo ">> building DeepSpeed's async_io op for $(VENV) (4-5 minutes on 2 cores, once)"
	$(call ARCH_LIST,$(PY)) $(PY) -m fastpersist.build_ops async_io
	@touch $@

$(VENV_OLDEST)/.async-io-built: $(VENV_OLDEST)/.installed fastpersist/build_ops.py | apt-packages
	@echo ">> building DeepSpeed's async_io op for $(VENV_OLDEST) (4-5 minutes on 2 cores, once)"
	$(call ARCH_LIST,$(PY_OLDEST)) $(PY_OLDEST) -m fastpersist.build_ops async_io
	@touch $@

$(VENV_MIDDLE)/.async-io-built: $(VENV_MIDDLE)/.installed fastpersist/build_ops.py | apt-packages
	@echo ">> building DeepSpeed's async_io op for $(VENV_MIDDLE) (4-5 minutes on 2 cores, once)"
	$(call ARCH_LIST,$(PY_MIDDLE)) $(PY_MIDDLE) -m fastpersist.build_ops async_io
	@touch $@

## test: set up, lint, then every test in three streams at once: the newest releases' suite in two
## halves, and the oldest-supported and middle subsets followed by the recovery tests. Most tests wait on
## processes and services they start, so two cores serve three streams: each alone kept a core about
## two-thirds busy.
test: setup
	$(MAKE) lint
	$(MAKE) -k -j3 --output-sync=target test-newest-a test-newest-b test-older-and-recovery

## test-newest: the whole suite (newest releases) in one pytest run, but for the recovery tests
test-newest: setup-newest
	$(PY) -m pytest -m "not recovery" $(PYTEST_ARGS)

# The halves of test-newest that `make test` runs side by side, of about equal length.
# Measured on the 2-core build machine, all three streams at once (load 4 to 5): the first 26 min 32 s,
# the second 37 min 6 s before tests/fastpersist and tests/lightning_storage_plugins (3.6 min alone)
# moved to the first; the older subsets and the recovery tests 28 min 37 s. Later (2026-11-29) the first
# took 29 min 35 s and the second 25 min 58 s, so tests/test_examples.py (30 s alone) moved to the second.
# In the whole suite's order (tests/lightning_storage_plugins' Redis Cluster test counts the keys of the
# session's cluster before tests/smartredis_io has used it).
NEWEST_A := tests/dataflux_ckpt tests/fastpersist tests/lightning_storage_plugins tests/smartredis_io \
	tests/test_readme.py tests/test_fast_paths.py tests/test_checkpoint_io.py tests/test_layers.py
test-newest-a: setup-newest
	$(PY) -m pytest -p no:cacheprovider -m "not recovery" $(NEWEST_A) $(PYTEST_ARGS)

test-newest-b: setup-newest
	$(PY) -m pytest -p no:cacheprovider -m "not recovery" tests $(addprefix --ignore=,$(NEWEST_A)) $(PYTEST_ARGS)

test-older-and-recovery: setup
	$(MAKE) -k -j1 test-oldest test-middle test-recovery

# The recovery job killed, preempted, requeued by Slurm and restarted by torchrun, 20 times per plugin
# and event (pytest's `recovery` marker): 23 minutes on the busy 2-core build machine, so a target of
# their own (`make test` runs it after the older subsets, beside the newest suite's halves).
test-recovery: setup-newest
	$(PY) -m pytest -m recovery tests/recovery $(PYTEST_ARGS)

test-oldest: setup-oldest
	$(PY_OLDEST) -m pytest -p no:cacheprovider $(OLDEST_TESTS) $(OLDEST_DESELECT) $(PYTEST_ARGS)

test-middle: setup-middle
	$(PY_MIDDLE) -m pytest -p no:cacheprovider $(MIDDLE_TESTS) $(OLDER_ENV_DESELECT) $(PYTEST_ARGS)

lint: setup-newest
	$(PY) -m ruff check .

## bench: set up, run the main job (python -m benchmarks.lightning_ckpt on its embedded default)
bench: setup-newest
	$(PY) -m benchmarks.lightning_ckpt $(ARGS)

clean:
	rm -rf $(VENV) $(VENV_OLDEST) $(VENV_MIDDLE) .tools .pytest_cache .hypothesis build *.egg-info $(MODULE)
