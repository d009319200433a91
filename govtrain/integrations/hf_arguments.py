"""What a governed Trainer refuses of its arguments (`integrations/hf.py`): the keyword arguments that would replace
what the run owns (its data, collator, model, update or loss: `REFUSED`), and the `TrainingArguments` that would
change what the run samples, computes on, or charges (`check_arguments`).
"""

from __future__ import annotations

from transformers import TrainingArguments

from govtrain.errors import Code, ConfigError
from govtrain.train.governed import GovernedRun

REFUSED = {
    "train_dataset": "the run draws its own Poisson batches from training.data",
    "data_collator": "the run's task encodes its batches",
    "model_init": "the model is run.model",
    "optimizers": "the update is RUN.toml's [optimizer] (and [prism] or [muon])",
    "optimizer_cls_and_kwargs": "the update is RUN.toml's [optimizer] (and [prism] or [muon])",
    "compute_loss_func": "the loss is one value per example: override per_example_loss",
    "peft_config": "run.model already carries the run's LoRA adapters",
}


def check_arguments(args: TrainingArguments, run: GovernedRun) -> None:
    """Refuse the Trainer settings that would change what the run samples, computes on, or charges."""
    device = next(run.model.parameters()).device
    problems = []
    if args.gradient_accumulation_steps != 1:
        problems.append("gradient_accumulation_steps must be 1 (a logical step is the Poisson batch; set "
                        "training.physical_batch for chunks)")
    if args.fp16 or args.bf16:
        problems.append("fp16 and bf16 must be False (set training.precision in RUN.toml; TRL's SFTConfig turns bf16 "
                        "on by default)")
    if args.gradient_checkpointing:
        problems.append("gradient_checkpointing must be False (per-sample gradients are formed from the forward the "
                        "run recorded, not a recomputed one)")
    if args.n_gpu > 1:
        problems.append("one device per process (several GPUs: start one process each with torchrun)")
    if args.world_size != run._run.world.size:
        problems.append(f"the Trainer sees {args.world_size} processes, but the run was opened in "
                        f"{run._run.world.size}: start every process with torchrun, and open the run in each")
    if run._run.sharded:
        problems.append("the run shards its model (training.fsdp), and the Trainer's loop is not built for FSDP's "
                        "equal forwards per rank: train it with govtrain train --nproc N or the Python API")
    if args.device.type != device.type or (device.index is not None and args.device.index not in (None, device.index)):
        problems.append(f"the Trainer would put the model on {args.device}, but the run trains on {device} "
                        "(set training.device, or use_cpu=True)")
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):
        problems.append("packing and padding_free put several examples in one sequence: per-example clipping needs "
                        "one example per row")
    if args.include_num_input_tokens_seen not in ("no", False, None):
        problems.append("include_num_input_tokens_seen must be off")
    if problems:
        raise ConfigError(Code.RUN_CONFIG_INVALID, "TrainingArguments: " + "; ".join(problems))
