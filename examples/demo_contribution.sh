#!/usr/bin/env bash
# govtrain demo at the contribution level: epsilon protects one movie's snippets, not one snippet.
# One contribution per training movie (465), attested, admitted, trained on with q over movies, scored, audited.
# Run it with `make demo-contribution` (after `make demo`, or on its own). Everything lands in demo-out/contribution/.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=demo-out/contribution
rm -rf "$OUT" && mkdir -p "$OUT/keys"
LEDGER="sqlite:///./$OUT/ledger.db"

if [ -t 1 ]; then step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }; else step() { printf '\n== %s\n' "$*"; }; fi
show() { printf '$ %s\n' "$*"; "$@"; }

step "Data: the demo's held-out movies again; every other movie is a contribution of its own"
show "$BIN/python" examples/prepare_data.py --out "$OUT/data" --per-movie

step "Operator: a ledger whose policy fixes privacy_unit = \"contribution\" (at most 2 snippets per movie a step)"
cp keys.example/{policy-contribution.toml,attester.key,attester.pub,ledger.key,ledger.pub} "$OUT/keys/"
chmod 600 "$OUT"/keys/*.key
show "$BIN/govtrain" init --policy "$OUT/keys/policy-contribution.toml" --ledger "$LEDGER" --key "$OUT/keys/ledger.key"

step "Contributors: one attestation per movie (sigma 3.5: at q = 0.25 over 50 steps that is epsilon ~2.2 per movie)"
show "$BIN/python" examples/attest_each.py "$OUT/data" --glob 'movie-*.jsonl' --key "$OUT/keys/attester.key" \
  --class public --clip-norm 1.0 --noise-multiplier 3.5 --eps-budget 3
"$BIN/govtrain" admit --batch "$OUT/data" --ledger "$LEDGER" | tail -n 2

step "Operator: the plan counts movies, and says what epsilon protects"
"$BIN/govtrain" plan --ledger "$LEDGER" --config examples/run-contribution.toml | head -n 4

step "Operator: 50 governed steps; each draws ~116 movies and at most 2 snippets of each"
show "$BIN/govtrain" train --config examples/run-contribution.toml --ledger "$LEDGER"
show "$BIN/govtrain" ledger status --ledger "$LEDGER"

step "Held-out accuracy (compare: the example-level demo at the same epsilon per snippet, docs/demo.md)"
show "$BIN/govtrain" eval --config examples/run-contribution.toml --data "$OUT/data/heldout.jsonl" --json

step "Auditor: verify, recomputing every movie's spend"
show "$BIN/govtrain-verify" --ledger "$LEDGER"
printf '\ncontribution-level demo finished: ledger at %s\n' "$OUT/ledger.db"
