# pve-gpu-recover. Quick start on a fresh Debian/Ubuntu machine, as root:
#   make lab    set up everything, build the lab, run recover.yml against it
#   make test   set up everything and pass the whole test suite
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements/dev.lock
STAMP := $(VENV)/.installed-$(shell sha256sum $(LOCK) | cut -c1-12)
LABCTL := /usr/bin/python3 tests/lab/labctl.py
SYSTEM_PACKAGES := lxc debootstrap openssh-server psmisc iproute2 python3 python3-venv git coreutils systemd
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup system-deps lab lab-up lab-down lab-status lint unit molecule test clean

setup: $(STAMP)  ## Controller venv with the pinned tooling (Python 3.12+)

$(STAMP): $(LOCK)
	@python=$$(scripts/find-python) && echo "setup: using $$python" && \
	  { [ -x $(BIN)/python ] && $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' || \
	    { rm -rf $(VENV) && "$$python" -m venv $(VENV); }; }
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes -r $(LOCK)
	rm -f $(VENV)/.installed-* && touch $@

system-deps:  ## Debian packages the lab needs (LXC, debootstrap, sshd)
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
	$(BIN)/ansible-playbook recover.yml

lint: setup  ## ruff and ansible-lint (production profile)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/ansible-lint

unit: setup system-deps  ## pytest unit tests of library/, module_utils/ and the lab stand-ins (seconds, no lab)
	$(BIN)/python -m pytest tests/unit -q

molecule: setup system-deps  ## molecule scenarios against the lab (molecule builds and removes it)
	$(BIN)/molecule test --all

test: lint unit molecule  ## Everything CI runs

clean: lab-down
	rm -rf $(VENV) .pytest_cache .ruff_cache reports
