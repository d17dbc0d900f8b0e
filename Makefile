# The two commands a new machine needs:  `make run`  and  `make test`.
# Everything else here is what those two are made of.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# What serving needs (`make run`), and that plus the tests', lint's and eval's tools.
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP   := $(VENV)/.installed-dev
# Extra flags for `make run`, e.g. make run ARGS="--port 6000 --log-format console"
ARGS   ?=
# PYTHONWARNINGS: setuptools tells every editable install of a flat layout, at length,
# that folders named like the package may shadow it (none do here): noise to a newcomer.
PIP    := PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet

.PHONY: install install-serve assets test-assets run test test-unit lint format proto docs \
	check clean

$(SERVE_STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP) -e clients/python -e .
	touch $@

$(DEV_STAMP): $(SERVE_STAMP)
	$(PIP) -e clients/python -e '.[dev]'
	touch $@

install-serve: $(SERVE_STAMP)
install: $(DEV_STAMP)

# llama-server built from the pinned llama.cpp source + the stand-in model, into the cache
# (~/.cache/rerank-server, or RERANK_CACHE_DIR). Minutes the first time, instant after.
assets: install-serve
	$(BIN)/rerank-server prepare

# The tests also drive the chat and completion paths (SmolLM2-135M-Instruct) and the
# rerank backend (MiniLM-L6 with an untrained rank head, for llama-server --rerank, made
# with llama.cpp's converter in a venv with torch): minutes, once.
test-assets: install
	$(BIN)/rerank-server prepare --chat-model --rank-head-model

run: assets
	@echo
	@echo "Starting rerank-server on 127.0.0.1:50051 with a managed llama-server."
	@echo "In another terminal, try:"
	@echo "  $(BIN)/rerank-client 'what do cats eat?' 'Cats are obligate carnivores that eat meat.' 'The stock market fell.' 'Kittens need milk.'"
	@echo
	$(BIN)/rerank-server --managed $(ARGS)

test: test-assets
	$(BIN)/pytest

# The fast loop: no llama-server, no subprocesses of the server; seconds.
test-unit: install
	$(BIN)/pytest tests/unit -q

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/python scripts/gen_config_doc.py --check
	$(BIN)/python scripts/check_deploy.py

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

proto: install
	$(BIN)/python scripts/gen_protos.py

# The settings tables in docs/configuration.md, from rerank_server/settings.py.
docs: install
	$(BIN)/python scripts/gen_config_doc.py

check: lint test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
