"""One rank of a governed run for tests/test_attacks_distributed_review.py: `python -m tests.distributed_review_worker
SPEC.json`. Like tests/distributed_worker.py (the library API under RANK / WORLD_SIZE), and it records, per logical
step, what the lead drew (the texts of the drawn examples, before each rank takes its share) and what this rank
trained on (the texts of the examples in its chunks), in `out/rank{r}.json`. SPEC may also name a `behaviour` of the
user's loop: "break" leaves the loop after `after` steps; "rate" sets this rank's learning rate from the step's
training loss after `after` steps (issue 34, item 8: every rank checks its own update's hyperparameters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    from govtrain.distributed import shares
    from govtrain.train import run as run_module
    from govtrain.train.governed import GovernedRun

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"drawn": [], "took": [], "steps": None}
    holder: dict = {}

    def text(i: int) -> str:
        return holder["run"].examples.items[i].text

    share = shares.share

    def recording_share(units, size, rank_):  # type: ignore[no-untyped-def]
        if rank_ == 0:  # the lead's whole draw, as every rank receives it
            record["drawn"].append(sorted(text(i) for unit in units for i in unit))
        return share(units, size, rank_)

    shares.share = recording_share
    draw = run_module.Run.draw

    def recording_draw(self):  # type: ignore[no-untyped-def]
        holder["run"] = self
        chunks = draw(self)
        record["took"].append(sorted(self.examples.items[i].text for c in chunks for i in c.indices))
        return chunks

    run_module.Run.draw = recording_draw  # type: ignore[method-assign]
    try:
        with GovernedRun.open(spec["config"], spec["ledger"], key=spec.get("key"), insecure_seed=spec.get("seed"),
                              log=lambda line: None) as run:
            for batch in run.batches():
                output = run.model(**batch.inputs)
                loss = run.step(run.per_example_loss(output, batch))
                if spec.get("behaviour") == "break" and loss is not None and run.steps >= spec.get("after", 1):
                    break
                if spec.get("behaviour") == "rate" and loss is not None and run.steps == spec.get("after", 1):
                    from govtrain.integrations.hf import GovernedOptimizer

                    GovernedOptimizer(run).param_groups[0]["lr"] = 5 * loss
            if run.steps >= run.total_steps:
                record["steps"] = run.save().steps
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    from tests.distributed_worker import as_command

    as_command(main, sys.argv[1])
