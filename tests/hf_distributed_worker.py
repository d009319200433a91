"""One rank of a governed run trained by `GovernedTrainer`, for tests/test_hf_distributed.py:
`python -m tests.hf_distributed_worker SPEC.json`.

SPEC: {"config": RUN.toml path, "ledger": URL, "seed": insecure seed, "out": folder, "trainer": the Trainer's
output_dir}. Under RANK / WORLD_SIZE (as torchrun sets them) it is one rank of several; without them, the single
process. It writes `out/trainer-rank{r}.pt`: the trained adapter (every trainable parameter), the Trainer's
global step, its training and evaluation logs, the count of its steps this rank took with an empty share, and
the type of the model the Trainer trained.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    import torch
    import transformers

    from govtrain.integrations import hf
    from govtrain.integrations.hf import GovernedTrainer
    from govtrain.train.governed import GovernedRun

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    idle = []
    training_step = hf._Governed.training_step

    def counting(self, model, inputs, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        idle.append(inputs.idle)
        return training_step(self, model, inputs, num_items_in_batch)

    hf._Governed.training_step = counting  # type: ignore[method-assign]
    seen: list[dict] = []

    class Logs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(dict(logs or {}))

    with GovernedRun.open(spec["config"], spec["ledger"], insecure_seed=spec["seed"], log=lambda line: None) as run:
        args = transformers.TrainingArguments(output_dir=spec["trainer"], use_cpu=True, report_to=[], logging_steps=1,
                                              save_strategy="steps", save_steps=2, lr_scheduler_type="linear",
                                              eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2,
                                              average_tokens_across_devices=False, disable_tqdm=True)
        # (average_tokens_across_devices: the Trainer would scale BERT's mean evaluation loss by the process count)
        tokenizer = run.tokenizer
        heldout = [tokenizer(text) | {"labels": label} for text, label in (("good movie", 1), ("awful film", 0))] * 4
        trainer = GovernedTrainer(run, args=args, eval_dataset=heldout, compute_metrics=accuracy, callbacks=[Logs()],
                                  processing_class=tokenizer)
        trainer.train()
        adapter = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
        wrapped = type(trainer.model_wrapped).__name__
        steps = run.steps
    torch.save({"adapter": adapter, "global_step": trainer.state.global_step, "steps": steps, "logs": seen,
                "idle": sum(idle), "wrapped": wrapped, "world_size": args.world_size},
               Path(spec["out"]) / f"trainer-rank{rank}.pt")


def accuracy(prediction) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


if __name__ == "__main__":
    main(sys.argv[1])
