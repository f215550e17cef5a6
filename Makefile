# pve-gpu-recover.
#   make setup  the runtime only (.venv: ansible-core 2.19, ansible-runner, prometheus-client, uv): what running the
#               playbooks and the drift runner needs; safe on a Proxmox VE node, which may be its own controller
# Quick start on a fresh Debian 12/13 machine that is NOT a Proxmox VE node (a VM or CT of its own), as root:
#   make lab    set up everything, build the lab, run recover.yml against it
#   make test   set up everything (the test tooling too) and pass the whole test suite
#   make sanity ansible-test sanity on the built collection, both ends (apart from make test: minutes; CI runs it)
# The lab installs Debian's lxc (it conflicts with PVE's lxc-pve) and runs its own sshd and LXC cgroups: on a PVE
# node every target that would install or build it refuses before it starts (scripts/pve-guard).
# Supported: ansible-core 2.19 to 2.21. The low end (ansible-core 2.19, the system's Python 3.11+) is .venv, what
# every target uses; the high end (ansible-core 2.21, Python 3.12+) is .venv-latest, tested by `make test-latest`
# where a Python 3.12+ exists (skipped loudly where none does; a failure under CI=true).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
# $(call stamp,DIR,KIND,LOCK): the file that says DIR holds exactly LOCK's packages.
stamp = $(1)/.installed-$(2)-$(shell sha256sum $(3) | cut -c1-12)
# The runtime (make setup) and, on top of it in the same venv, the test tooling (make setup-dev): both locks agree
# on every package they share (make lock compiles dev.lock constrained by runtime.lock).
RUNTIME_LOCK := requirements/runtime.lock
RUNTIME_STAMP := $(call stamp,$(VENV),runtime,$(RUNTIME_LOCK))
DEV_LOCK := requirements/dev.lock
DEV_STAMP := $(call stamp,$(VENV),dev,$(DEV_LOCK))
LATEST := .venv-latest
LATEST_BIN := $(LATEST)/bin
LATEST_LOCK := requirements/dev-latest.lock
LATEST_STAMP := $(call stamp,$(LATEST),dev,$(LATEST_LOCK))
LABCTL := /usr/bin/python3 tests/lab/labctl.py
# What the lab and the tests need from Debian, installed without recommends. No service is installed for the tests'
# sake: promtool is taken out of Debian's prometheus package into .cache (make promtool), never the server.
SYSTEM_PACKAGES := lxc debootstrap openssh-server psmisc iproute2 python3 python3-venv git coreutils systemd
# tests/unit/test_monitoring.py runs this promtool (PROMTOOL=/path/to/promtool: one of your own instead).
PROMTOOL ?= $(CURDIR)/.cache/promtool/promtool
export PROMTOOL
# `make lock` compiles against PyPI itself, whatever index or find-links this machine's pip or uv settings name.
UV_COMPILE := env -u UV_INDEX -u UV_INDEX_URL -u UV_DEFAULT_INDEX -u UV_EXTRA_INDEX_URL -u UV_FIND_LINKS \
	-u UV_CONSTRAINT $(BIN)/uv pip compile --quiet --no-config --universal --generate-hashes \
	--default-index https://pypi.org/simple
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# .venv's tools first (once: a sub-make inherits the exported PATH).
ifeq (,$(findstring $(CURDIR)/$(BIN):,$(PATH)))
export PATH := $(CURDIR)/$(BIN):$(PATH)
endif
# The high end's tools first: its ansible-playbook is what molecule and the unit tests' subprocesses run.
LATEST_ENV := PATH=$(CURDIR)/$(LATEST_BIN):$(PATH)

.PHONY: setup setup-dev setup-latest lock uv-wheel pve-guard system-deps promtool lab lab-up lab-down lab-status lint \
	sanity sanity-latest unit molecule test test-latest unit-latest molecule-latest clean

# $(call venv,DIR,LOCK,MINOR,KIND): DIR made (or remade, when its Python is not the one find-python picks) on a
# Python 3.MINOR+ and given LOCK's packages; $(call stamp,DIR,KIND,LOCK) says it is done.
define venv
@python=$$(scripts/find-python $(3)) && echo "setup: $(1) on $$python ($(2))" && \
  want=$$("$$python" -c 'import sys; print(sys.prefix, *sys.version_info[:3])') && \
  have=$$($(1)/bin/python -c 'import sys; print(sys.base_prefix, *sys.version_info[:3])' 2>/dev/null || true) && \
  { [ "$$want" = "$$have" ] || { rm -rf $(1) && "$$python" -m venv $(1); }; }
$(1)/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes -r $(2)
rm -f $(1)/.installed-$(4)-* && touch $@
endef

setup: $(RUNTIME_STAMP)  ## The runtime only, in .venv: ansible-core 2.19, ansible-runner, prometheus-client, uv

$(RUNTIME_STAMP): $(RUNTIME_LOCK)
	$(call venv,$(VENV),$(RUNTIME_LOCK),11,runtime)

setup-dev: $(DEV_STAMP)  ## The runtime and the test tooling in .venv (molecule, ansible-lint, pytest, ruff): make test's

$(DEV_STAMP): $(DEV_LOCK)
	$(call venv,$(VENV),$(DEV_LOCK),11,dev)

setup-latest: $(LATEST_STAMP)  ## Second venv .venv-latest: ansible-core 2.21 on a Python 3.12+ (the high end)

$(LATEST_STAMP): $(LATEST_LOCK)
	$(call venv,$(LATEST),$(LATEST_LOCK),12,dev)

lock: setup  ## Recompile the hashed locks from requirements/*.in with uv, against PyPI
	$(UV_COMPILE) --python-version 3.11 requirements/runtime.in -o requirements/runtime.lock
	$(UV_COMPILE) --python-version 3.11 -c requirements/runtime.lock requirements/dev.in -o requirements/dev.lock
	$(UV_COMPILE) --python-version 3.12 requirements/dev-latest.in -o requirements/dev-latest.lock

uv-wheel: setup  ## PyPI's uv wheel (requirements/runtime.lock's version, hash-checked) in .whl/, for CTs without uv
	@req=$$(mktemp) && trap 'rm -f "$$req"' EXIT && sed -n '/^uv==/,/^ *# via/p' $(RUNTIME_LOCK) | grep -v '# via' > "$$req" && \
	  $(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	    --platform manylinux_2_17_x86_64 --require-hashes -r "$$req" -d .whl && ls .whl/uv-*.whl

# First in every target that installs system packages or builds the lab, so that it refuses before anything is done.
pve-guard:
	@scripts/pve-guard "make $(or $(MAKECMDGOALS),setup)"

system-deps: pve-guard  ## Debian packages the lab and the tests need (LXC, debootstrap, sshd), without recommends
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  [ "$$(id -u)" = 0 ] || { echo "system-deps: run as root to install: $$missing" >&2; exit 1; }; \
	  echo "system-deps: installing $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

promtool: $(PROMTOOL)  ## promtool alone, out of Debian's prometheus package, in .cache/promtool (no server installed)

$(PROMTOOL):
	scripts/fetch-promtool $(@D)

lab-up: system-deps  ## Build (or repair) the lab: CT 200 with 8 GPUs, CT 201, the node's sshd
	$(LABCTL) create

lab-down:  ## Remove the lab (the rootfs cache stays)
	$(LABCTL) destroy

lab-status:
	$(LABCTL) status

lab: pve-guard setup lab-up  ## Quick start: set up, build the lab, run recover.yml against CT 200
	$(BIN)/ansible-playbook -i inventory/lab recover.yml

lint: setup-dev  ## ruff and ansible-lint (production profile)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# ansible.cfg's inventory stops any run without -i; a syntax check needs no inventory (ansible-lint turns the
	@# setting off for its own check, not for the one that resolves molecule's import_playbook).
	ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED=false $(BIN)/ansible-lint

# Not part of `test`: 1.5 to 4.5 minutes per end on 2 shared cores (pylint most of it), more than the unit tests
# and lint together. .ci/run runs it after `make test`. The high end as test-latest: skipped loudly without a
# Python 3.12+, a failure under CI=true.
sanity: setup  ## ansible-test sanity on the collection as built: ansible-core 2.19, then 2.21 where a Python 3.12+ is
	scripts/sanity $(VENV)
	@if scripts/find-python 12 >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory sanity-latest; \
	elif [ "$${CI:-}" = true ]; then \
	  echo "sanity: FAILED: CI=true but no Python 3.12+, so ansible-core 2.21's sanity is untested" >&2; exit 1; \
	else \
	  echo "sanity: SKIPPED ansible-core 2.21 (no Python 3.12+; PYTHON_LATEST names one): only 2.19 was checked" >&2; \
	fi

sanity-latest: setup-latest  ## ansible-test sanity on the high end alone, ansible-core 2.21 (tests/sanity/ignore-2.21.txt)
	scripts/sanity $(LATEST)

unit: pve-guard setup-dev system-deps promtool  ## pytest unit tests of library/, module_utils/ and the lab stand-ins (seconds, no lab)
	$(BIN)/python -m pytest tests/unit -q

molecule: pve-guard setup-dev system-deps  ## molecule scenarios against the lab (molecule builds and removes it)
	$(BIN)/molecule test --all

# The high end where a Python 3.12+ exists. A fresh Debian 12 has none: skipped, loudly; under CI=true (CI has
# one) a missing one fails, so CI never silently tests one end only.
test-latest:  ## The high end: unit tests and molecule's default scenario on ansible-core 2.21 (Python 3.12+)
	@if scripts/find-python 12 >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory unit-latest molecule-latest; \
	elif [ "$${CI:-}" = true ]; then \
	  scripts/find-python 12 || true; \
	  echo "test-latest: FAILED: CI=true but no Python 3.12+, so ansible-core 2.21 (the high end) is untested" >&2; \
	  exit 1; \
	else \
	  echo "##############################################################################################" >&2; \
	  echo "# test-latest: SKIPPED. No Python 3.12+ here, so ansible-core 2.21 (the supported range's high #" >&2; \
	  echo "# end) was NOT tested: only 2.19. Install a Python 3.12+ or set PYTHON_LATEST to test it;     #" >&2; \
	  echo "# CI tests both ends (under CI=true a missing Python 3.12+ fails).                             #" >&2; \
	  echo "##############################################################################################" >&2; \
	fi

unit-latest: pve-guard setup-latest system-deps promtool  ## The unit tests on the high end
	$(LATEST_ENV) $(LATEST_BIN)/python -m pytest tests/unit -q -p no:cacheprovider

molecule-latest: pve-guard setup-latest system-deps  ## Molecule's default scenario on the high end
	$(LATEST_ENV) $(LATEST_BIN)/molecule test -s default

test: pve-guard lint unit molecule test-latest  ## Everything CI runs: both ends of the supported ansible-core range

clean: lab-down
	rm -rf $(VENV) $(LATEST) .pytest_cache .ruff_cache reports .cache/promtool
