# Two commands do all set-up on a fresh Debian/Ubuntu machine: `make demo`, `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := virtinst chromium vagrant vagrant-libvirt python3-venv python3-dev gcc pkg-config libvirt-dev libvirt-clients \
	libvirt-daemon-system qemu-system-x86 pciutils pci.ids libxml2-utils ovmf \
	busybox-static dropbear-bin openssh-client linux-image-amd64 zstd debootstrap \
	cloud-init xorriso groff-base man-db python3-libvirt
APT_STAMP := .deps/apt.stamp
VENV_STAMP := $(VENV)/.stamp
PYTEST_ARGS ?=
# Test trees are thousands of small files: keep them in memory when /dev/shm is there.
# One directory per pytest run below: a run clears its own at start, never the other's.
BASETEMP = $(if $(wildcard /dev/shm),--basetemp=/dev/shm/gpuvfio-pytest-$(1),)
# The unit and package lanes on every core (pytest-xdist), a test file to a worker, so a
# module's fixtures (a built wheel, an Ansible fleet) are made once; the files of many long,
# independent tests (tests/conftest.py SPREAD) go test by test (loadgroup).
PARALLEL := -n auto --dist loadgroup
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): every
# worker would otherwise compile and assertion-rewrite each test module again (11.6 s against
# 3.6 s to collect tests/unit), and every command a test starts would compile what it imports.
# It goes under the venv (PYTHONPYCACHEPREFIX, which pytest's rewriting honours too), not into
# __pycache__ folders beside the sources.
PYCACHE := $(CURDIR)/$(VENV)/pycache
PYTEST := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(PYCACHE) PATH=$(CURDIR)/$(VENV)/bin:$$PATH \
	$(PY) -m pytest

.PHONY: all deps demo test test-current test-current-daemon test-fast mutate mutate-survivors mutate-changed bench samples sample-report docs clean

all: test

# System packages, installed once (idempotent: apt skips what is there).
$(APT_STAMP): Makefile
	@mkdir -p .deps
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi
	@touch $@

$(VENV_STAMP): pyproject.toml $(APT_STAMP)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,report]' virtme-ng --config-settings editable_mode=compat
	$(PY) -m compileall -q gpuvfio
	@touch $@

deps: $(VENV_STAMP)

demo: deps
	@for host in gpuvfio/samples/*.host; do \
	  echo; echo "=== $$(basename $$host .host) ==="; \
	  $(VENV)/bin/gpuvfio --root $$host list; \
	  $(VENV)/bin/gpuvfio --root $$host doctor || true; \
	done
	@echo; echo "=== end to end: passthrough on an emulated GPU host (kernel + nested lanes, ~4-10 min) ==="
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m tests.lanes.demo

# The command reference and the man page, from the command tree (tests/unit/test_docs.py checks them).
docs: deps
	$(PY) -m gpuvfio.cli.manpage docs

# Every lane, each of them required (GPUVFIO_REQUIRE_LANES=1: a lane that skips fails). The lanes
# that boot guests under QEMU's emulation (daemon, kernel, nested) run after the others, one test
# at a time: their guests slow down with the machine's load until their SSH and boot waits run
# out. Both runs always run; make fails when either failed. The last line says how long each took.
test: deps
	@rc=0; began=$$SECONDS; \
	set -x; \
	GPUVFIO_REQUIRE_LANES=1 $(PYTEST) $(call BASETEMP,parallel) $(PARALLEL) tests/unit tests/package $(PYTEST_ARGS) || rc=1; \
	guests=$$SECONDS; \
	GPUVFIO_REQUIRE_LANES=1 $(PYTEST) $(call BASETEMP,guests) tests/daemon tests/kernel tests/nested $(PYTEST_ARGS) || rc=1; \
	{ set +x; } 2>/dev/null; \
	echo "make test: $$((SECONDS - began)) s (unit and package lanes $$((guests - began)) s, guest lanes $$((SECONDS - guests)) s)"; \
	exit $$rc

# The kernel lane again on the current stack: Debian 13's own kernel, fetched from Debian's
# archive by apt (tests/lanes/current.py; cached in .deps/current by version, its modules installed
# in /lib/modules as its package would, since virtme-ng's guest sees this machine's root).
test-current: deps
	@kernel=$$($(PY) -m tests.lanes.current) || exit 1; \
	set -x; \
	GPUVFIO_KL_KERNEL=$$kernel GPUVFIO_REQUIRE_LANES=1 $(PYTEST) $(call BASETEMP,current) tests/kernel $(PYTEST_ARGS)

# The daemon lane inside a Debian 13 root (libvirt 11.3, QEMU 10.0, Python 3.13, dropbear 2025.89;
# debootstrap, cached in .deps/current by what went into it): about 5 min with the root's build.
test-current-daemon: deps
	$(PY) -m tests.lanes.current daemon -q $(PYTEST_ARGS)

# The unit lane (tests/unit) alone: no daemons, no guests, no wheel build.
test-fast: deps
	$(PYTEST) $(call BASETEMP,fast) $(PARALLEL) tests/unit $(PYTEST_ARGS)

# Mutation testing of the core (tests/mutation/mutate.py, mutmut on 2 cores, about an hour):
# writes docs/mutation.md and docs/mutation-scores.json.
MUTATE := env -u PYTHONDONTWRITEBYTECODE PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) tests/mutation/mutate.py
mutate: deps
	$(PY) -m pip install -q -e '.[mutate]' --config-settings editable_mode=compat
	$(MUTATE) --jobs 2

# A group's recorded survivors again, and the functions changed since it was measured (minutes
# where the whole group takes up to an hour): after tests are added. GROUP=host for one group.
mutate-survivors: deps
	$(PY) -m pip install -q -e '.[mutate]' --config-settings editable_mode=compat
	$(MUTATE) --jobs 2 --survivors $(if $(GROUP),--group $(GROUP))

# The mutants of the core functions changed since the commit their group was measured on
# (docs/mutation-scores.json; .ci/run): one surviving untriaged fails.
mutate-changed: deps
	$(PY) -m pip install -q -e '.[mutate]' --config-settings editable_mode=compat
	$(MUTATE) --jobs 2 --changed

bench: deps
	$(PY) benchmarks/bench_startup.py
	$(PY) benchmarks/bench_inventory.py
	$(PY) benchmarks/bench_domain_xml.py
	$(PY) benchmarks/bench_fleet.py
	$(PY) benchmarks/bench_attach.py

samples: deps
	$(PY) tests/make_samples.py --regenerate

clean:
	rm -rf $(VENV) .deps

# The sample testbed report in docs/ (synthetic numbers, labelled as such).
sample-report: deps
	rm -rf docs/testbed-sample && $(PY) -c "import sys; sys.path.insert(0, '.'); \
	from tests.testbed_data import write_synthetic; write_synthetic('docs/testbed-sample')" && \
	$(PY) -m gpuvfio testbed report docs/testbed-sample && rm -rf docs/testbed-sample/results docs/testbed-sample/identity.json
