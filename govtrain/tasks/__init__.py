"""What a run learns (RUN.toml `[model] task`): how a data row becomes an example, how examples become a batch
of model inputs, and each example's own loss.

    task = task_for(config.file)
    example = task.example(row, where)                 # validate one row of a contribution's data
    batch = task.encode(examples, tokenizer, max_length, device)
    losses = task.per_example_loss(model(**batch.inputs), batch)   # [B]: one loss per example
    task.report(sum of task.tally(output, batch) over batches)    # held-out figures (`govtrain eval`)

A loss is always one value per example (docs/design.md §5): a mean over one example's tokens is fine, a mean over the
batch's tokens couples examples and is never formed.
"""

from __future__ import annotations

from govtrain.tasks.base import Batch, Task
from govtrain.tasks.causal_lm import CausalLM
from govtrain.tasks.classification import Classification

__all__ = ["Batch", "Task", "CausalLM", "Classification", "task_for"]


def task_for(file) -> Task:  # type: ignore[no-untyped-def]
    """The task a run file names, with its column names."""
    model, data = file.model, file.data
    if model.task == "sequence-classification":
        return Classification(num_labels=model.num_labels, text_column=data.text_column, label_column=data.label_column)
    if model.task == "causal-lm":
        return CausalLM(text_column=data.text_column, prompt_column=data.prompt_column,
                        completion_column=data.completion_column, messages_column=data.messages_column)
    raise ValueError(f"unknown task {model.task!r}")
