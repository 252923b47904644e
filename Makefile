# Two commands do all set-up on a machine with python3, make and git:
#   make serve   create .venv, install, build the reference model, start serving (PyTriton)
#   make test    the same set-up, then the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One resolver run for every extra the suite exercises (PyTriton needs numpy < 2).
EXTRAS ?= dev,triton,http,ray

.PHONY: serve demo test models bench lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	@touch $@

models: $(STAMP)
	$(BIN)/servekit models build resnet50

# KServe v2 on HTTP :8000, gRPC :8001, metrics :8002 (Ctrl-C stops it).
serve: models
	$(BIN)/servekit serve --model resnet50

demo: models
	$(BIN)/servekit demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: models
	$(BIN)/python bench/raw.py
	$(BIN)/python bench/batcher.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
