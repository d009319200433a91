"""Held-out evaluation of a trained adapter (`govtrain eval`): accuracy for a classifier, per-token loss and
perplexity for a causal LM, on a data file in the run's task format.

    model, tokenizer = load_trained(config, adapter)     # the run's base, pooling and every saved adapter
    examples = read_examples(path, task_for(config.file), (config.file.data.label_column,))
    figures = evaluate(model, tokenizer, task, examples, max_length)

Evaluation reads no ledger and writes nothing: it is not training, spends no budget, and its data need no
attestation. Everything that scores a model (the CLI, the demo's non-private reference, the utility bench)
goes through `evaluate`, so the figures compared side by side are computed one way.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from govtrain.errors import Code, ConfigError
from govtrain.train.config import RunConfig

ADAPTER_CONFIG = "adapter_config.json"


def read_examples(path: Path, task, integer_columns: Sequence[str] = ()) -> list[Any]:  # type: ignore[no-untyped-def]
    """Every row of the data at `path` (any format training reads: a JSON Lines, CSV or Parquet file, or a saved
    dataset directory) as the task's example; a row the task cannot use is refused (BAD_DATA, naming file and
    row). `integer_columns`: the CSV columns whose integer cells become `int` (the label), as in training."""
    from govtrain.data import read_data
    from govtrain.train.data import rows_of

    if not path.exists():
        raise ConfigError(Code.DATA_UNREADABLE, f"--data {path}: no such file or directory")
    rows = rows_of(read_data(path), integer_columns)
    examples = [task.example(row, where) for where, row in rows]
    if not examples:
        raise ConfigError(Code.BAD_DATA, f"--data {path}: no rows to evaluate on")
    return examples


def load_trained(config: RunConfig, adapter: Path):
    """(model, tokenizer): the adapter folder `govtrain train` saved on the run's base model, as training built
    it (its pooling, the default adapter and one sub-folder per `adapter` class, all active), in eval mode. A folder
    govtrain released loads through `govtrain.load` (its record, the base model of `[model]` bound by its tree
    hash), and `[model]` must describe it; an older one, with no record, is rebuilt from `[model]` alone."""
    from peft import PeftModel

    from govtrain.release.artifact import RECORD
    from govtrain.release.load import load
    from govtrain.train.model import load_base, quiet_loading
    from govtrain.models.pooling import use_pooling

    if not (adapter / ADAPTER_CONFIG).is_file():
        raise ConfigError(Code.BAD_ARGUMENT, f"--adapter {adapter}: no {ADAPTER_CONFIG} there; name the folder "
                                             "`govtrain train` saved (training.output)")
    if (adapter / RECORD).is_file():
        loaded = load(adapter, base=config.model_spec)
        section, record = config.file.model, loaded.record
        said = {"task": section.task, "pooling": section.pooling,
                "num_labels": section.num_labels if section.task == "sequence-classification" else None}
        differ = [f"{key} = {value!r} (the adapter's: {getattr(record, key)!r})" for key, value in said.items()
                  if getattr(record, key) != value]
        if differ:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"--adapter {adapter} was not trained as [model] says: "
                                                       f"{'; '.join(differ)} (its {RECORD})")
        return loaded.model, loaded.tokenizer
    base, tokenizer, _ = load_base(config)
    if config.file.model.task == "sequence-classification":
        base = use_pooling(base, config.file.model.pooling)  # the pooling the adapter was trained under
    with quiet_loading():
        model = PeftModel.from_pretrained(base, adapter)
        names = ["default"]
        for folder in sorted(p for p in adapter.iterdir() if (p / ADAPTER_CONFIG).is_file()):
            model.load_adapter(folder, adapter_name=folder.name)
            names.append(folder.name)
    model.base_model.set_adapter(names)
    return model.eval(), tokenizer


def evaluate(model, tokenizer, task, examples: Sequence[Any], max_length: int, *,  # type: ignore[no-untyped-def]
             batch_size: int = 32, on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The task's figures (`task.report`) over `examples`, in batches of `batch_size`, without gradients. The
    model's mode is left as it was found. `on_batch(done)` is told how many examples are done after each batch
    (a progress display)."""
    import torch

    task.check(examples, tokenizer, max_length)
    device = next(model.parameters()).device
    totals: Counter = Counter()
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(examples), batch_size):
                batch = task.encode(examples[start:start + batch_size], tokenizer, max_length, device)
                totals.update(task.tally(model(**batch.inputs), batch))
                if on_batch is not None:
                    on_batch(min(start + batch_size, len(examples)))
    finally:
        model.train(training)
    return task.report(totals)
