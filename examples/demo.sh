#!/usr/bin/env bash
# govtrain demo: keys -> attest -> admit (admitted and rejected) -> checkpoint -> proof -> withdraw -> train -> eval
# -> release -> verify.
# Run it with `make demo`, which creates .venv first. Everything lands in demo-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=demo-out
rm -rf "$OUT" && mkdir -p "$OUT/keys" "$OUT/attestations"
LEDGER="sqlite:///./$OUT/ledger.db"

if [ -t 1 ]; then step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }; else step() { printf '\n== %s\n' "$*"; }; fi
show() { printf '$ %s\n' "$*"; "$@"; }
expect_exit() {  # run a command that must exit with code $1 (a refusal, or verify's 6 for tainted) and show it
  local want=$1; shift
  printf '$ %s\n' "$*"
  set +e; "$@"; local code=$?; set -e
  echo "   -> exit $code"
  [ "$code" -eq "$want" ] || { echo "demo: expected exit $want, got $code" >&2; exit 1; }
}
expect_rejection() { expect_exit 3 "$@"; }  # a request the ledger or the gate refuses, with its one-line error

step "Data: all 12,808 labelled Rotten Tomatoes snippets; a tenth of the movies held out, the rest split by movie into 30 contributions"
show "$BIN/python" examples/prepare_data.py --out "$OUT/data" --contributions 30

step "Keys: the demo's INSECURE attester, ledger, release and rights-issuer keys (keys.example/); a rogue attester"
cp keys.example/{policy.toml,attester.key,attester.pub,ledger.key,ledger.pub,release.key,release.pub} "$OUT/keys/"
cp keys.example/{issuer.key,issuer.pub} "$OUT/keys/"
chmod 600 "$OUT"/keys/*.key   # git does not keep modes; govtrain refuses keys others can read
show "$BIN/govtrain" keys generate --out "$OUT/keys" --name rogue

step "Operator: create the ledger from the policy"
show "$BIN/govtrain" init --policy "$OUT/keys/policy.toml" --ledger "$LEDGER" --key "$OUT/keys/ledger.key"

step "Contributors: sign attestations (18 public, 8 sensitive, 4 restricted)"
for i in $(seq -w 0 29); do
  n=$((10#$i))
  if   [ "$n" -lt 18 ]; then class=public;     clip=1.0; sigma=0.8; eps=8
  elif [ "$n" -lt 26 ]; then class=sensitive;  clip=0.5; sigma=1.0; eps=3
  else                       class=restricted; clip=0.5; sigma=1.6; eps=1; fi
  "$BIN/govtrain" attest "$OUT/data/contrib-$i.jsonl" --key "$OUT/keys/attester.key" \
    --contributor "movie-group-$i" --class "$class" --clip-norm "$clip" --noise-multiplier "$sigma" \
    --eps-budget "$eps" --id "contrib-$i" --out "$OUT/data/contrib-$i.jsonl.cose"
done | tail -n 3
echo "   ... 30 attestations written"

step "Operator: admit them in one batch"
show "$BIN/govtrain" admit --batch "$OUT/data" --ledger "$LEDGER"

step "Operator: deliberate rejections: an untrusted key, a bound looser than its class, altered data, a replay"
mkdir -p "$OUT/rejected"
head -n 20 "$OUT/data/heldout.jsonl" > "$OUT/rejected/extra.jsonl"
"$BIN/govtrain" attest "$OUT/rejected/extra.jsonl" --key "$OUT/keys/rogue.key" --contributor mallory \
  --class public --clip-norm 1 --noise-multiplier 1 --eps-budget 5 --out "$OUT/rejected/rogue.cose" >/dev/null
expect_rejection "$BIN/govtrain" admit "$OUT/rejected/rogue.cose" --data "$OUT/rejected/extra.jsonl" --ledger "$LEDGER"
"$BIN/govtrain" attest "$OUT/rejected/extra.jsonl" --key "$OUT/keys/attester.key" --contributor eve \
  --class sensitive --clip-norm 0.5 --noise-multiplier 0.6 --eps-budget 3 --out "$OUT/rejected/weak.cose" >/dev/null
expect_rejection "$BIN/govtrain" admit "$OUT/rejected/weak.cose" --data "$OUT/rejected/extra.jsonl" --ledger "$LEDGER"
cp "$OUT/data/contrib-00.jsonl" "$OUT/rejected/altered.jsonl"
echo '{"text": "a line slipped in after signing", "label": 1}' >> "$OUT/rejected/altered.jsonl"
expect_rejection "$BIN/govtrain" admit "$OUT/data/contrib-00.jsonl.cose" --data "$OUT/rejected/altered.jsonl" --ledger "$LEDGER"
expect_rejection "$BIN/govtrain" admit "$OUT/data/contrib-01.jsonl.cose" --data "$OUT/data/contrib-01.jsonl" --ledger "$LEDGER"

step "Operator: sign a checkpoint (C2SP signed note); the auditor keeps a copy"
show "$BIN/govtrain" ledger checkpoint --ledger "$LEDGER" --out "$OUT/trusted.checkpoint"

step "Contributor: get an inclusion proof and check it offline with the ledger's public key"
show "$BIN/govtrain" ledger prove contrib-03 --ledger "$LEDGER" --out "$OUT/contrib-03.tlog-proof" > /dev/null
head -n 3 "$OUT/contrib-03.tlog-proof" | cut -c1-60
show "$BIN/govtrain" ledger verify-proof "$OUT/contrib-03.tlog-proof" --key "$OUT/keys/ledger.pub" \
  --origin example.org/govtrain/demo --attestation "$OUT/data/contrib-03.jsonl.cose"

step "Contributor: withdraw (appended, never erased; spend is never refunded)"
show "$BIN/govtrain" withdraw contrib-07 --ledger "$LEDGER" --reason "consent withdrawn"
expect_rejection "$BIN/govtrain" withdraw contrib-07 --ledger "$LEDGER" --reason "again"

step "Status"
show "$BIN/govtrain" ledger status --ledger "$LEDGER"
show "$BIN/govtrain" ledger status --ledger "$LEDGER" --contribution contrib-07

step "Operator: what would 50 steps cost? (the policy's accountant; profiles resolved on the run's model)"
show "$BIN/govtrain" privacy epsilon --q 0.02 --sigma 0.8 --steps 50 --delta 1e-5
show "$BIN/govtrain" privacy sigma --epsilon 3 --delta 1e-5 --q 0.02 --steps 50
"$BIN/govtrain" plan --ledger "$LEDGER" --config examples/run.toml > "$OUT/plan.txt"
head -n 12 "$OUT/plan.txt"; echo "   ... (the whole plan, per contribution: $OUT/plan.txt)"

step "Operator: 50 governed DP-LoRA steps of ~237 snippets on MiniLM; contrib-05 withdraws while it runs"
"$BIN/govtrain" train --config examples/run.toml --ledger "$LEDGER" &
TRAIN=$!
until [ "$("$BIN/govtrain" ledger status --ledger "$LEDGER" --json | "$BIN/python" -c 'import json,sys; print(json.load(sys.stdin)["epoch"])')" -ge 1 ]; do
  kill -0 "$TRAIN" 2>/dev/null || break
  sleep 2
done
show "$BIN/govtrain" withdraw contrib-05 --ledger "$LEDGER" --reason "consent withdrawn during training"
wait "$TRAIN"
show "$BIN/govtrain" ledger status --ledger "$LEDGER"
show "$BIN/govtrain" ledger status --ledger "$LEDGER" --contribution contrib-05

step "Held-out accuracy: the governed adapter next to a non-private LoRA run of the same length"
show "$BIN/govtrain" eval --config examples/run.toml --data "$OUT/data/heldout.jsonl" --adapter "$OUT/adapter" --json
show "$BIN/python" examples/nonprivate.py --config examples/run.toml --train "$OUT/data" --steps 50 --batch 237 \
  --out "$OUT/nonprivate"
show "$BIN/govtrain" eval --config examples/run.toml --data "$OUT/data/heldout.jsonl" --adapter "$OUT/nonprivate" --json
show "$BIN/python" examples/plot_epsilon.py --ledger "$LEDGER" --out "$OUT/epsilon.png"

step "Release: sign the adapter's manifest (its files by SHA-256, ε per class and layer group, the run's proof)"
RUN_ID=$("$BIN/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["run"]["run_id"])' \
  "$OUT/adapter/govtrain.json")   # the run that wrote the adapter, as its govtrain.json records
expect_exit 2 "$BIN/govtrain" release --run "$RUN_ID" --adapter "$OUT/adapter" --out "$OUT/release.dsse" \
  --ledger "$LEDGER" --key "$OUT/keys/release.key"
echo "   contrib-05 withdrew while the run trained: the adapter learnt from it in the steps before (its ε stands;"
echo "   nothing is unlearnt). A withdrawal binds every release of what it trained, so govtrain release refuses to"
echo "   sign it unless told to (--yes), and the release it signs is tainted from the start, as if the withdrawal"
echo "   had come after it:"
show "$BIN/govtrain" release --run "$RUN_ID" --adapter "$OUT/adapter" --out "$OUT/release.dsse" --ledger "$LEDGER" \
  --key "$OUT/keys/release.key" --yes
expect_exit 6 "$BIN/govtrain" release verify "$OUT/release.dsse" --key "$OUT/keys/release.pub" \
  --ledger-key "$OUT/keys/ledger.pub" --adapter "$OUT/adapter" --ledger "$LEDGER"
echo "   verify: the manifest, its files and its ledger proof are good, and it is tainted (exit 6). The demo's"
echo "   inference gate (examples/inference.toml) serves it marked tainted for its 30-day grace period, the time to"
echo "   train and sign a release without contrib-05, and refuses it (409) after. Serve it: docs/demo.md."

step "Auditor: verify the ledger without any data, against the checkpoint kept earlier"
show "$BIN/govtrain-verify" --ledger "$LEDGER" --trusted-checkpoint "$OUT/trusted.checkpoint"
printf '\ndemo finished: ledger at %s\n' "$OUT/ledger.db"
