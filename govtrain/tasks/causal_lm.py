"""Causal language modelling (RUN.toml `[model] task = "causal-lm"`): next-token prediction on one of three row
forms, each example's loss the mean of its own target tokens' cross-entropy.

    {"text": "..."}                                    every token after the first is a target
    {"prompt": "...", "completion": "..."}             the completion's tokens (and an EOS after them) only
    {"messages": [{"role": ..., "content": ...}, ...]} the assistant turns, rendered by the chat template

Why each rule:

- **Per-example mean** (docs/design.md §5): a mean over the batch's tokens would weight an example by its length
  relative to the others, coupling examples; the mean over one example's own target tokens does not.
- **Exact prompt/completion boundary**: the prompt is tokenized as the tokenizer tokenizes any text (with its
  own special tokens, e.g. Llama's BOS), the completion without special tokens, and the two id lists are
  concatenated, so no token straddles the boundary and the loss never reaches into the prompt. Put the
  separating space in the completion (" Paris"), as the model would generate it. An EOS follows the completion
  so that the model learns where a completion ends; a text row gets only the tokenizer's own special tokens.
- **Chat turns**: the conversation is rendered with `tokenizer.apply_chat_template` (no chat template: the row
  is refused). An assistant turn's characters run from the end of the conversation before it rendered with the
  generation prompt to the end of the conversation up to it (its end-of-turn marker included), when the template
  renders each shorter conversation as a prefix of the longer one; every assistant turn is then a target. A
  template that rewrites earlier turns (some drop earlier reasoning) fails that check: then only the last
  assistant turn is a target, and a template that fails it even there is refused. Tokens overlapping an
  assistant turn's characters (the tokenizer's offsets) are its targets.
- **Truncation and padding**: sequences are cut to `max_length` tokens from the right and padded on the right
  with the attention mask off; targets are marked by position, never by token id, so padding with the EOS id
  (the pad token of a tokenizer that has none, `govtrain.train.model`) never hides a real EOS target. An example
  left with no target token inside `max_length` (a prompt that long, a one-token text) is refused by `check`
  before a run writes any spend: raise `max_length`, since the contributor's signed data cannot be changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from govtrain.errors import Code, ConfigError
from govtrain.tasks.base import Batch, probe_texts

IGNORE = -100  # torch's cross-entropy ignore_index: a position that is not a target


@dataclass(frozen=True)
class Text:
    text: str
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Completion:
    prompt: str
    completion: str
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Chat:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Tokens:
    """One example's token ids and which of them are targets (predicted from the tokens before them)."""

    ids: list[int]
    targets: list[bool]


@dataclass(frozen=True)
class CausalLM:
    causal: ClassVar[bool] = True  # a position's logit reads the tokens before it only (`Task.causal`)

    text_column: str = "text"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    name: str = "causal-lm"

    # -- rows -------------------------------------------------------------------------------------------

    def example(self, row: Mapping[str, Any], where: str) -> Text | Completion | Chat:
        """One of the three forms, by which columns the row has; a row with columns of two forms is refused
        rather than guessed at."""
        chat, pair = self.messages_column in row, self.prompt_column in row or self.completion_column in row
        plain = self.text_column in row
        if chat + pair + plain != 1:
            pair_form = f"{{\"{self.prompt_column}\": str, \"{self.completion_column}\": str}}"
            chat_form = f"{{\"{self.messages_column}\": [{{\"role\": str, \"content\": str}}, ...]}}"
            raise ConfigError(Code.BAD_DATA, f"{where}: need exactly one of {{\"{self.text_column}\": str}}, "
                                             f"{pair_form} or {chat_form}")
        if chat:
            return self._chat(row[self.messages_column], where)
        if pair:
            prompt, completion = row.get(self.prompt_column), row.get(self.completion_column)
            if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
                raise ConfigError(Code.BAD_DATA, f"{where}: need {{\"{self.prompt_column}\": str, "
                                                 f"\"{self.completion_column}\": non-empty str}}")
            return Completion(prompt, completion, where)
        text = row[self.text_column]
        if not isinstance(text, str) or not text:
            raise ConfigError(Code.BAD_DATA, f"{where}: need {{\"{self.text_column}\": non-empty str}}")
        return Text(text, where)

    def _chat(self, messages: Any, where: str) -> Chat:
        shape = f"{where}: \"{self.messages_column}\" must be a list of {{\"role\": str, \"content\": str}}"
        if not isinstance(messages, list) or not messages:
            raise ConfigError(Code.BAD_DATA, shape)
        turns = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"] \
                    or not isinstance(message.get("content"), str):
                raise ConfigError(Code.BAD_DATA, shape)
            turns.append((message["role"], message["content"]))
        if not any(role == "assistant" for role, _ in turns):
            raise ConfigError(Code.BAD_DATA, f"{where}: no \"assistant\" message, so nothing to learn: the loss is on "
                                             "assistant turns only")
        return Chat(tuple(turns), where)

    # -- before any spend -------------------------------------------------------------------------------

    def check(self, examples: Sequence[Text | Completion | Chat], tokenizer: Any, max_length: int) -> None:
        """Refuse, before a run writes spend, any example that `encode` could not give a target token."""
        for example in examples:
            truncated(tokens(example, tokenizer), example, max_length)

    # -- batches and losses -----------------------------------------------------------------------------

    def encode(self, examples: Sequence[Text | Completion | Chat], tokenizer: Any, max_length: int,
               device: Any) -> Batch:
        import torch

        rows = [truncated(tokens(e, tokenizer), e, max_length) for e in examples]
        width = max((len(r.ids) for r in rows), default=1)
        pad = pad_id(tokenizer)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, row in enumerate(rows):  # right padding: a real token's position is the same in any batch
            n = len(row.ids)
            ids[i, :n] = torch.tensor(row.ids)
            mask[i, :n] = 1
            labels[i, :n] = torch.tensor([t if target else IGNORE for t, target in zip(row.ids, row.targets)])
        return Batch({"input_ids": ids.to(device), "attention_mask": mask.to(device)}, labels.to(device))

    def per_example_loss(self, output: Any, batch: Batch) -> Any:
        total, count = token_losses(output, batch)
        return total / count

    def probe_examples(self) -> list[Text]:
        return [Text(text, where="the batch-independence probe") for text in probe_texts()]

    def tally(self, output: Any, batch: Batch) -> dict[str, float]:
        total, count = token_losses(output, batch)
        return {"examples": len(batch), "tokens": int(count.sum()), "loss_sum": float(total.double().sum())}

    def report(self, totals: Mapping[str, float]) -> dict[str, Any]:
        """Per-token loss over every target token of the set (each token weighs the same) and its exp."""
        import math

        loss = totals["loss_sum"] / totals["tokens"]
        return {"task": self.name, "examples": int(totals["examples"]), "tokens": int(totals["tokens"]),
                "loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}


def token_losses(output: Any, batch: Batch) -> tuple[Any, Any]:
    """([B] summed cross-entropy of each example's target tokens, [B] their count), in fp32 or wider (bf16 logits
    are widened, float64 ones kept): logits at position t predict the token at t + 1."""
    import torch
    import torch.nn.functional as F

    logits = output.logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = batch.targets[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    return per_token.sum(1), (labels != IGNORE).sum(1).to(per_token.dtype)


def pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is None:
        raise RuntimeError("the tokenizer has no pad token: load it with govtrain.train.model.load_base")
    return int(tokenizer.pad_token_id)


def truncated(row: Tokens, example: Text | Completion | Chat, max_length: int) -> Tokens:
    """`row` cut to its first `max_length` tokens; refused if no target token is left."""
    ids, targets = row.ids[:max_length], row.targets[:max_length]
    if any(targets):
        return Tokens(ids, targets)
    where = example.where or "an example"
    if any(row.targets):
        raise ConfigError(Code.BAD_DATA, f"{where}: no target token within model.max_length = {max_length} (it has "
                                         f"{len(row.ids)} tokens): raise model.max_length; a contribution's signed "
                                         "data cannot be cut")
    raise ConfigError(Code.BAD_DATA, f"{where}: no target token (a text needs two tokens or more)")


def tokens(example: Text | Completion | Chat, tokenizer: Any) -> Tokens:
    """The example's ids and target marks, before truncation (module docstring: the rules)."""
    if isinstance(example, Text):
        ids = list(tokenizer(example.text, add_special_tokens=True)["input_ids"])
        return Tokens(ids, [i > 0 for i in range(len(ids))])
    if isinstance(example, Completion):
        prompt = list(tokenizer(example.prompt, add_special_tokens=True)["input_ids"])
        completion = list(tokenizer(example.completion, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            completion.append(int(tokenizer.eos_token_id))
        ids = prompt + completion
        return Tokens(ids, [i >= len(prompt) and i > 0 for i in range(len(ids))])
    return _chat_tokens(example, tokenizer)


def _chat_tokens(example: Chat, tokenizer: Any) -> Tokens:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(Code.BAD_DATA, f"{example.where}: a \"messages\" row needs a tokenizer with a chat template, "
                                         "and this model's has none: use {\"prompt\", \"completion\"} rows, or a model "
                                         "whose tokenizer_config.json sets chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(Code.BAD_DATA, f"{example.where}: locating assistant turns needs a fast tokenizer "
                                         "(character offsets), and this model's is a slow one")
    full = _render(tokenizer, example.messages)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)  # the template holds them
    spans = _assistant_spans(tokenizer, example, full)
    targets = [i > 0 and any(start < end_ and stop > start_ for start_, end_ in spans)
               for i, (start, stop) in enumerate(encoded["offset_mapping"])]
    return Tokens(list(encoded["input_ids"]), targets)


def _render(tokenizer: Any, messages: Sequence[tuple[str, str]], prompt: bool = False) -> str:
    return tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                         tokenize=False, add_generation_prompt=prompt)


def _span(tokenizer: Any, messages: Sequence[tuple[str, str]], k: int, full: str) -> tuple[int, int] | None:
    """The characters of assistant turn `k` in `full`, or None when the template does not render the shorter
    conversations as prefixes of the longer ones (so the turn cannot be located exactly)."""
    try:
        before = _render(tokenizer, messages[:k], prompt=True) if k else ""
        upto = _render(tokenizer, messages[:k + 1])
    except Exception:  # a template may refuse a conversation cut there (e.g. one that must start with a user)
        return None
    if not upto.startswith(before) or not full.startswith(upto) or len(upto) == len(before):
        return None
    return len(before), len(upto)


def _assistant_spans(tokenizer: Any, example: Chat, full: str) -> list[tuple[int, int]]:
    turns = [k for k, (role, _) in enumerate(example.messages) if role == "assistant"]
    spans = [_span(tokenizer, example.messages, k, full) for k in turns]
    if all(span is not None for span in spans):
        return spans  # type: ignore[return-value]
    if spans[-1] is not None:
        return [spans[-1]]  # the template rewrites earlier turns: the last assistant turn alone
    raise ConfigError(Code.BAD_DATA, f"{example.where}: the tokenizer's chat template does not render this "
                                     "conversation's turns as prefixes of each other, so its assistant tokens cannot "
                                     "be located: use {\"prompt\", \"completion\"} rows")
