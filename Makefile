# Nightwatch developer entry points. README's quickstart is `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEBIAN_PACKAGES := slurm-wlm slurmdbd munge mariadb-server prometheus prometheus-alertmanager docker-compose
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test venv system-packages services lint soak clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The offline CPU build; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# numpy from source fails on 3.11 here; megatron-core 0.19.2 declares Python >= 3.12
	# but runs on 3.11 (pyproject pins the same version for 3.12+).
	$(BIN)/pip install -q --only-binary=:all: 'numpy>=1.26'
	$(BIN)/pip install -q --ignore-requires-python megatron-core==0.19.2
	$(BIN)/pip install -q -e '.[train,postgres,plot,dev]'
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the integration tests need; package scripts must not start services
# (the test harness starts its own, on loopback).
system-packages:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

services: system-packages
	@pg_isready -q -h 127.0.0.1 -p 5432 || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start

demo: venv
	$(BIN)/nightwatch demo

test: venv services
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=20

# The overnight proof (docs/benchmarks.md, "Chaos soak"): real SLURM + Prometheus + PostgreSQL.
SEED ?= 7
MINUTES ?= 20
soak: venv services
	$(BIN)/python benchmarks/chaos_soak.py --seed $(SEED) --minutes $(MINUTES)

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .cluster
