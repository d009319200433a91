"""Tiny causal LMs built offline for tests: a word-level tokenizer with BOS, EOS and a chat template, and
randomly initialised Llama (grouped-query attention), GPT-2 (Conv1D projections) and Qwen2 configs."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = ("the a cat dog sat on mat what is where did who yes no red blue green paris rome capital of france "
         "italy answer question user assistant system say hello world good bad movie very").split()
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
# A template that drops earlier assistant turns' content (as some reasoning templates drop earlier thoughts):
# shorter conversations are then not prefixes of longer ones.
REWRITING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['role'] != 'assistant' or loop.last "
                      "%}{{ m['content'] }}{% endif %}<|im_end|> {% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
VOCAB = len(SPECIAL) + len(WORDS)


def tokenizer(chat_template: str | None = CHAT_TEMPLATE, bos: bool = True) -> transformers.PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer, no pad token (as GPT-2's and Llama's), BOS prepended when `bos`."""
    vocab = {word: i for i, word in enumerate([*SPECIAL, *WORDS])}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.add_special_tokens(SPECIAL)
    if bos:
        inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = chat_template
    return fast


def config(family: str, layers: int = 2):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True, **common)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=128, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                                        tie_word_embeddings=False, **common)
    raise ValueError(family)


TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], "gpt2": ["c_attn", "c_proj"],
           "qwen2": ["q_proj", "v_proj", "o_proj", "up_proj"]}


def model(family: str, layers: int = 2, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(family, layers))


def save(folder: Path, family: str = "llama", layers: int = 6, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A tiny random causal LM and its tokenizer in `folder`, as a Hugging Face model directory."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(chat_template).save_pretrained(folder)
    model(family, layers).save_pretrained(folder)
    return folder
