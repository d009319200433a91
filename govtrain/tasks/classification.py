"""Sequence classification: a row `{"text": str, "label": int}`; the loss is each example's cross-entropy.

Batches are padded on the right whatever the tokenizer's own `padding_side` (decoder tokenizers such as
GPT-2's, Llama's and Qwen's often pad left). With left padding an example's absolute positions depend on the
longest example in its batch, so its gradient depends on the others and one example moves the clipped sum
by more than its C_i (issue 20, item 2: 1.23 C for a GPT-2 classifier). The side is passed to the call, so the
user's tokenizer object is left as it was; `govtrain.routing.independence` checks the property before a run
writes any spend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from govtrain.data.columns import require_columns
from govtrain.errors import Code, ConfigError
from govtrain.tasks.base import Batch, probe_texts


@dataclass(frozen=True)
class Labelled:
    text: str
    label: int


@dataclass(frozen=True)
class Classification:
    causal: ClassVar[bool] = False  # the label is read from the whole row at once (`Task.causal`)

    num_labels: int
    text_column: str = "text"
    label_column: str = "label"
    name: str = "sequence-classification"

    def example(self, row: Mapping[str, Any], where: str) -> Labelled:
        require_columns(row, (self.text_column, self.label_column), where)
        text, label = row[self.text_column], row[self.label_column]
        if not isinstance(text, str) or isinstance(label, bool) or not isinstance(label, int) \
                or not 0 <= label < self.num_labels:
            raise ConfigError(Code.BAD_DATA, f"{where}: need {{\"{self.text_column}\": str, \"{self.label_column}\": "
                                             f"int in [0, {self.num_labels})}}")
        return Labelled(text, label)

    def check(self, examples: Sequence[Labelled], tokenizer: Any, max_length: int) -> None:
        """Nothing to refuse: truncation never leaves a labelled example without its target (the label)."""

    def encode(self, examples: Sequence[Labelled], tokenizer: Any, max_length: int, device: Any) -> Batch:
        import torch

        inputs = tokenizer([e.text for e in examples], padding=True, padding_side="right", truncation=True,
                           max_length=max_length, return_tensors="pt").to(device)
        return Batch(dict(inputs), torch.tensor([e.label for e in examples], dtype=torch.long, device=device))

    def probe_examples(self) -> list[Labelled]:
        return [Labelled(text, i % self.num_labels) for i, text in enumerate(probe_texts())]

    def per_example_loss(self, output: Any, batch: Batch) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(output.logits.float(), batch.targets, reduction="none")

    def tally(self, output: Any, batch: Batch) -> dict[str, float]:
        predicted = output.logits.argmax(-1)
        counts = {"examples": len(batch), "correct": int((predicted == batch.targets).sum())}
        for label in batch.targets.tolist():
            counts[f"label {label}"] = counts.get(f"label {label}", 0) + 1
        return counts

    def report(self, totals: Mapping[str, float]) -> dict[str, Any]:
        """Accuracy, and that of always answering the set's most frequent label: the floor a model must beat."""
        n = int(totals["examples"])
        majority = max((v for k, v in totals.items() if k.startswith("label ")), default=0)
        return {"task": self.name, "examples": n, "accuracy": totals["correct"] / n, "majority": majority / n}
