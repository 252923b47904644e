# Two commands do all set-up on a machine with python3, make and git:
#   make serve   create .venv, install, build the reference model, start serving
#   make test    the same set-up, then the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test models bench lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $@

models: $(STAMP)
	$(BIN)/servekit models build resnet50

serve: models
	$(BIN)/servekit demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: models
	$(BIN)/python bench/raw.py
	$(BIN)/python bench/batcher.py --no-ray

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
