# pve-gpu-recover. Quick start on a fresh Debian 12/13 (or Proxmox VE 8/9) machine, as root:
#   make lab    set up everything, build the lab, run recover.yml against it
#   make test   set up everything and pass the whole test suite
#   make sanity ansible-test sanity on the built collection, both ends (apart from make test: minutes; CI runs it)
# Supported: ansible-core 2.19 to 2.21. The low end (ansible-core 2.19, the system's Python 3.11+) is .venv, what
# every target uses; the high end (ansible-core 2.21, Python 3.12+) is .venv-latest, tested by `make test-latest`
# where a Python 3.12+ exists (skipped loudly where none does; a failure under CI=true).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements/dev.lock
STAMP := $(VENV)/.installed-$(shell sha256sum $(LOCK) | cut -c1-12)
LATEST := .venv-latest
LATEST_BIN := $(LATEST)/bin
LATEST_LOCK := requirements/dev-latest.lock
LATEST_STAMP := $(LATEST)/.installed-$(shell sha256sum $(LATEST_LOCK) | cut -c1-12)
LABCTL := /usr/bin/python3 tests/lab/labctl.py
SYSTEM_PACKAGES := lxc debootstrap openssh-server psmisc iproute2 python3 python3-venv git coreutils systemd prometheus
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# .venv's tools first (once: a sub-make inherits the exported PATH).
ifeq (,$(findstring $(CURDIR)/$(BIN):,$(PATH)))
export PATH := $(CURDIR)/$(BIN):$(PATH)
endif
# The high end's tools first: its ansible-playbook is what molecule and the unit tests' subprocesses run.
LATEST_ENV := PATH=$(CURDIR)/$(LATEST_BIN):$(PATH)

.PHONY: setup setup-latest lock uv-wheel system-deps lab lab-up lab-down lab-status lint sanity sanity-latest unit molecule \
	test test-latest unit-latest molecule-latest clean

# $(call venv,DIR,LOCK,MINOR): DIR made (or remade, when its Python is not the one find-python picks) on a Python
# 3.MINOR+ and given exactly LOCK's packages; DIR/.installed-<the lock's hash> says it is done.
define venv
@python=$$(scripts/find-python $(3)) && echo "setup: $(1) on $$python" && \
  want=$$("$$python" -c 'import sys; print(sys.prefix, *sys.version_info[:3])') && \
  have=$$($(1)/bin/python -c 'import sys; print(sys.base_prefix, *sys.version_info[:3])' 2>/dev/null || true) && \
  { [ "$$want" = "$$have" ] || { rm -rf $(1) && "$$python" -m venv $(1); }; }
$(1)/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes -r $(2)
rm -f $(1)/.installed-* && touch $(1)/.installed-$$(sha256sum $(2) | cut -c1-12)
endef

setup: $(STAMP)  ## Controller venv .venv: ansible-core 2.19 and the tooling on the system's Python 3.11+

$(STAMP): $(LOCK)
	$(call venv,$(VENV),$(LOCK),11)

setup-latest: $(LATEST_STAMP)  ## Second venv .venv-latest: ansible-core 2.21 on a Python 3.12+ (the high end)

$(LATEST_STAMP): $(LATEST_LOCK)
	$(call venv,$(LATEST),$(LATEST_LOCK),12)

lock: setup  ## Recompile both hashed locks from requirements/*.in with uv
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes requirements/dev.in \
	  -o requirements/dev.lock
	$(BIN)/uv pip compile --quiet --universal --python-version 3.12 --generate-hashes requirements/dev-latest.in \
	  -o requirements/dev-latest.lock

uv-wheel: setup  ## PyPI's uv wheel (requirements/dev.lock's version, hash-checked) in .whl/, for CTs without uv
	@req=$$(mktemp) && trap 'rm -f "$$req"' EXIT && sed -n '/^uv==/,/^ *# via/p' $(LOCK) | grep -v '# via' > "$$req" && \
	  $(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	    --platform manylinux_2_17_x86_64 --require-hashes -r "$$req" -d .whl && ls .whl/uv-*.whl

system-deps:  ## Debian packages the lab and the tests need (LXC, debootstrap, sshd; promtool from prometheus)
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  [ "$$(id -u)" = 0 ] || { echo "system-deps: run as root to install: $$missing" >&2; exit 1; }; \
	  echo "system-deps: installing $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

lab-up: system-deps  ## Build (or repair) the lab: CT 200 with 8 GPUs, CT 201, the node's sshd
	$(LABCTL) create

lab-down:  ## Remove the lab (the rootfs cache stays)
	$(LABCTL) destroy

lab-status:
	$(LABCTL) status

lab: setup lab-up  ## Quick start: set up, build the lab, run recover.yml against CT 200
	$(BIN)/ansible-playbook -i inventory/lab recover.yml

lint: setup  ## ruff and ansible-lint (production profile)
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

unit: setup system-deps  ## pytest unit tests of library/, module_utils/ and the lab stand-ins (seconds, no lab)
	$(BIN)/python -m pytest tests/unit -q

molecule: setup system-deps  ## molecule scenarios against the lab (molecule builds and removes it)
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

unit-latest: setup-latest system-deps  ## The unit tests on the high end
	$(LATEST_ENV) $(LATEST_BIN)/python -m pytest tests/unit -q -p no:cacheprovider

molecule-latest: setup-latest system-deps  ## Molecule's default scenario on the high end
	$(LATEST_ENV) $(LATEST_BIN)/molecule test -s default

test: lint unit molecule test-latest  ## Everything CI runs: both ends of the supported ansible-core range

clean: lab-down
	rm -rf $(VENV) $(LATEST) .pytest_cache .ruff_cache reports
