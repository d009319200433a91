"""One rank of a governed run for tests/test_distributed.py: `python -m tests.distributed_worker SPEC.json`.

SPEC: {"config": RUN.toml path, "ledger": URL, "key": signing key, "seed": insecure seed, "out": folder}. Under
RANK / WORLD_SIZE it is one rank of several; without them, the single process. It trains through the library API
(`GovernedRun`) and writes, per step, every trainable parameter's privatized `.grad` as the update received it
(`out/grads-rank{r}.pt`), then saves the run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    import torch

    from govtrain.distributed.fsdp import full as whole  # a sharded `.grad` gathered (every rank, in step)
    from govtrain.mechanisms import update as update_module
    from govtrain.train.governed import GovernedRun

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    grads: list[dict[str, torch.Tensor]] = []
    step = update_module.Update.step

    def recording(self, noise_std):  # type: ignore[no-untyped-def]
        grads.append({n: whole(p.grad.detach()) for n, p in self.model.named_parameters()
                      if p.requires_grad and p.grad is not None})
        return step(self, noise_std)

    update_module.Update.step = recording  # type: ignore[method-assign]
    with GovernedRun.open(spec["config"], spec["ledger"], key=spec["key"], insecure_seed=spec["seed"],
                          log=lambda line: None) as run:
        for batch in run.batches():
            output = run.model(**batch.inputs)
            run.step(run.per_example_loss(output, batch))
        result = run.save()
    out = Path(spec["out"])
    torch.save({"grads": grads, "steps": result.steps, "run_id": result.run_id}, out / f"grads-rank{rank}.pt")


def as_command(main, argument: str) -> None:  # type: ignore[no-untyped-def]
    """`main(argument)`, a refusal reported as the command line reports it: one line, the documented exit code."""
    from govtrain.errors import GovtrainError

    try:
        main(argument)
    except GovtrainError as error:
        print(error.line(), file=sys.stderr)
        raise SystemExit(error.exit_code) from None


if __name__ == "__main__":
    as_command(main, sys.argv[1])
