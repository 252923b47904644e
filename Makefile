# Two commands do all set-up on a machine with python3, make and git:
#   make serve   create .venv, install, build the models, start serving (PyTriton)
#   make test    the same set-up, then the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One resolver run for every extra the suite exercises (PyTriton needs numpy < 2).
EXTRAS ?= dev,triton,http,ray,cloud

.PHONY: serve demo test models bench lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	@touch $@

# PyTorch's CPU build where this machine keeps one on disk (TORCH_WHEELS; the python
# machines CI runs on have /opt/wheels): TorchRunner, the device-kept outputs and CUDA
# shared memory then run their tests on the CPU. PyPI's torch is a CUDA build of several
# GB, so none is fetched: without the file those tests skip by name.
TORCH_WHEELS ?= /opt/wheels
TORCH := $(VENV)/.torch

$(TORCH): $(STAMP)
	@tag=$$($(BIN)/python -c 'import sys; print("cp%d%d" % sys.version_info[:2])'); \
	wheel=$$(ls $(TORCH_WHEELS)/torch-*+cpu-$$tag-*.whl 2>/dev/null | sort -V | tail -n1); \
	if [ -n "$$wheel" ]; then \
	  echo "installing $$wheel"; \
	  $(BIN)/python -m pip install -q --disable-pip-version-check "$$wheel"; \
	else echo "no CPU build of PyTorch in $(TORCH_WHEELS): the tests that need torch skip"; fi
	@touch $@

# The trained EfficientNet-Lite0 (real ImageNet class names) and the ResNet-50 reference workload.
MODELS := efficientnet_lite0 resnet50

models: $(STAMP)
	$(BIN)/servekit models build $(MODELS)

# KServe v2 on HTTP :8000, gRPC :8001, metrics :8002 (Ctrl-C stops it): each model and its
# <name>_image model. Try: .venv/bin/servekit infer --sample cat --url http://localhost:8000
serve: models
	$(BIN)/servekit serve $(addprefix --model ,$(MODELS))

demo: models
	$(BIN)/servekit demo

test: $(STAMP) $(TORCH)
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
