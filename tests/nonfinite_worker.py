"""One rank of a governed run whose loss is nan for one contribution's examples, for tests/test_attacks_nonfinite.py:
`python -m tests.nonfinite_worker SPEC.json` (the SPEC of tests/distributed_worker.py, and "also": a second word).
Every example holding the poisoned token (the contribution named "example": no other text has that word), and the
word "also" names where given, gets its loss times nan, so its gradient is nan. It writes, per step, every trainable
parameter's privatized `.grad` as the update received it and the run's count of non-finite units
(`out/nonfinite-rank{r}.pt`), also when the run stops (`diverged`)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


def poisoned(losses, batch, token: int, *, also: int | None = None,  # type: ignore[no-untyped-def]
             first_only: bool = False):
    """`losses` times nan for the examples that hold `token` (and `also`, when given; `first_only`: the first of
    them in the batch): a loss whose gradient is nan, as a diverging one's."""
    import torch

    hit = (batch.inputs["input_ids"] == token).any(1)
    if also is not None:
        hit = hit & (batch.inputs["input_ids"] == also).any(1)
    if first_only:
        hit = hit & (torch.cumsum(hit.long(), 0) == 1)
    return losses * torch.where(hit, math.nan, 1.0).to(losses.dtype)


def main(spec_path: str) -> None:
    import torch

    from govtrain.distributed.fsdp import full as whole  # a sharded `.grad` gathered (every rank, in step)
    from govtrain.errors import GovtrainError
    from govtrain.mechanisms import update as update_module
    from govtrain.train.governed import GovernedRun

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["out"])
    record: dict = {"grads": [], "counts": [], "error": None, "steps": 0}
    step = update_module.Update.step

    def recording(self, noise_std):  # type: ignore[no-untyped-def]
        record["grads"].append({n: whole(p.grad.detach()).clone() for n, p in self.model.named_parameters()
                                if p.requires_grad and p.grad is not None})
        return step(self, noise_std)

    update_module.Update.step = recording  # type: ignore[method-assign]
    try:
        with GovernedRun.open(spec["config"], spec["ledger"], key=spec["key"], insecure_seed=spec["seed"],
                              log=lambda line: None) as run:
            token = run.tokenizer.convert_tokens_to_ids("example")
            also = run.tokenizer.convert_tokens_to_ids(spec["also"]) if spec.get("also") else None
            for batch in run.batches():
                output = run.model(**batch.inputs)
                losses = poisoned(run.per_example_loss(output, batch), batch, token, also=also)
                loss = run.step(losses)
                if loss is not None:
                    record["counts"].append(getattr(run, "nonfinite", None))
            result = run.save()
            record["steps"] = result.steps
    except GovtrainError as error:
        record["error"] = error.code.value
        raise
    finally:
        torch.save(record, out / f"nonfinite-rank{rank}.pt")


if __name__ == "__main__":
    from tests.distributed_worker import as_command

    as_command(main, sys.argv[1])
