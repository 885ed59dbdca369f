# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo demo-s3 test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[torch,dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) tools/demo.py --store ./demo-store
	$(PY) tools/demo_dist.py --store ./demo-store

# Starts moto's S3 server on the loopback itself (the dev extra brings it): no account, no network.
demo-s3: $(VENV)/.installed
	$(PY) tools/demo_s3.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check castore tests tools benchmarks
	$(VENV)/bin/mypy castore

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_save_load.py

clean:
	rm -rf $(VENV) demo-store
