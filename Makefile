# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo demo-s3 demo-tiers test lint bench bench-s3 bench-async bench-export bench-fsdp2 cadence gpu-check clean

# Each pip step says what it installs first: the first run is minutes of pip --quiet.
$(VENV)/.installed: pyproject.toml Makefile setup.py castore/native/b3tree.c
	@echo "creating the virtual environment $(VENV) with $(PYTHON) ..."
	$(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH_SPEC) (CPU build, ~200 MB) into $(VENV): a few minutes the first time ..."
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	sh tools/blake3_sources.sh
	@echo "installing castore, its dev tools (pytest, ruff, mypy, boto3, moto, safetensors) and the lightning, transformers, accelerate and signing extras into $(VENV) ..."
	$(PY) -m pip install --quiet -e ".[torch,dev,lightning,transformers,accelerate,signing]"
	touch $@

demo: $(VENV)/.installed
	$(PY) tools/demo.py --store ./demo-store
	$(PY) tools/demo_dist.py --store ./demo-store

# Starts moto's S3 server on the loopback itself (the dev extra brings it): no account, no network.
demo-s3: $(VENV)/.installed
	$(PY) tools/demo_s3.py

# Tiers on 2 simulated nodes (4 ranks): node 1 is lost, the job resumes from its peer's
# copies (replicas=2), then from the durable tier (replicas=1); everything in ./demo-tiers.
demo-tiers: $(VENV)/.installed
	$(PY) tools/demo_tiers.py --dir ./demo-tiers

# One pytest-xdist worker per core; tests that share a costly module fixture
# (a reference training run, a saved multi-rank store) stay on one worker.
# PYTEST_ARGS="-n 0" runs the suite in one process.
# The suite starts hundreds of interpreters: with PYTHONDONTWRITEBYTECODE set (as some
# machines and CI images do) each would compile castore again; here they share the cache.
PYTEST_ARGS ?= -n auto --dist loadgroup
test: $(VENV)/.installed
	env -u PYTHONDONTWRITEBYTECODE CASTORE_EXPECT_B3TREE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check castore tests tools benchmarks
	$(VENV)/bin/mypy castore

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_save_load.py

# s3fs (the bench extra) for DCP's fsspec writer; `make test` does not need it.
$(VENV)/.installed-bench: $(VENV)/.installed
	@echo "installing the bench extra (s3fs, a pinned boto3) into $(VENV) ..."
	$(PY) -m pip install --quiet -e ".[torch,dev,bench]"
	touch $@

# castore on S3 against DCP's FsspecWriter (s3fs), both on one moto server.
# BENCH_S3_ARGS="--state-mib 64 --repeats 1" is the smoke run (under two minutes).
BENCH_S3_ARGS ?=
bench-s3: $(VENV)/.installed-bench
	$(PY) benchmarks/bench_s3.py $(BENCH_S3_ARGS)

# Async saves: stall and staging memory against a plain copy; bursts with and without stagger.
bench-async: $(VENV)/.installed
	$(PY) benchmarks/bench_async.py $(BENCH_ASYNC_ARGS)

# Export to safetensors against DCP's consolidation, one 1 GiB state saved by 4 ranks.
bench-export: $(VENV)/.installed
	$(PY) benchmarks/bench_export.py $(BENCH_EXPORT_ARGS)

# An FSDP2 model's state (256 MiB, 2 and 3 gloo ranks) against DCP, and against Meta's
# torch_checkpointing where it imports (it is not in the venv: the script's docstring says
# how to add it for one run). BENCH_FSDP2_ARGS=--small: the smoke run (under a minute).
bench-fsdp2: $(VENV)/.installed
	$(PY) benchmarks/bench_fsdp2.py $(BENCH_FSDP2_ARGS)

# The receipt of issue 13: a real DDP job with a save every K steps, every mode
# interleaved (castore sync and async, DCP save and async_save); writes
# cadence-out/receipt.json and cadence-out/steps.png (the run docs/PERFORMANCE.md quotes:
# benchmarks/results/cadence-*). CADENCE_ARGS=--quick: a smoke run.
$(VENV)/.installed-cadence: $(VENV)/.installed
	@echo "installing the cadence extra (matplotlib) into $(VENV) ..."
	$(PY) -m pip install --quiet -e ".[torch,dev,cadence]"
	touch $@

CADENCE_ARGS ?=
cadence: $(VENV)/.installed-cadence
	$(PY) tools/cadence.py $(CADENCE_ARGS)

# castore with CUDA tensors (async staging, loads into CUDA targets, CUDA RNG, 2 ranks), under
# three minutes; one skip line without CUDA. Needs a CUDA build of torch in the venv (the
# default install is the CPU build). GPU_CHECK_ARGS=--rehearse-on-cpu runs its logic on CPU.
gpu-check: $(VENV)/.installed
	$(PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) demo-store demo-tiers
