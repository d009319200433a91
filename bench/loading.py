"""The demo's adapter loaded as a user would, after `make demo`: `python bench/loading.py [FOLDER]`.

Prints the held-out accuracy through `govtrain.load` (to set beside `govtrain eval`'s, which the demo prints),
then what plain peft does with the same folder: `PeftModel.from_pretrained` on the base and
`AutoPeftModelForSequenceClassification.from_pretrained`, each either refused (the expected outcome for a
mean-pooling adapter) or loaded, and the base model name `adapter_config.json` gives.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"


def main(folder: str = "demo-out/adapter", heldout: str = "demo-out/data/heldout.jsonl") -> None:
    import torch
    from peft import AutoPeftModelForSequenceClassification, PeftModel
    from transformers import AutoModelForSequenceClassification

    import govtrain
    from govtrain.resolver.load import model_path

    torch.set_num_threads(2)
    rows = [json.loads(line) for line in Path(heldout).read_text().splitlines() if line.strip()]
    texts, labels = [r["text"] for r in rows], [int(r["label"]) for r in rows]
    loaded = govtrain.load(folder)
    predicted: list[int] = []
    for i in range(0, len(texts), 64):
        predicted += loaded.predict(texts[i:i + 64])
    accuracy = sum(p == y for p, y in zip(predicted, labels)) / len(labels)
    print(f"govtrain.load: accuracy {accuracy:.4f} on {len(labels)} held-out rows")

    plain = AutoModelForSequenceClassification.from_pretrained(model_path("minilm"), num_labels=2)
    attempts = {"PeftModel.from_pretrained": lambda: PeftModel.from_pretrained(plain, folder),
                "AutoPeftModelForSequenceClassification": lambda: AutoPeftModelForSequenceClassification
                .from_pretrained(folder)}
    for name, attempt in attempts.items():
        try:
            attempt()
            print(f"{name}: loaded")
        except Exception as e:  # the refusal is what a mean-pooling folder should get
            print(f"{name}: refused ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    print(f"adapter_config.json base_model_name_or_path: {config.get('base_model_name_or_path')}")


if __name__ == "__main__":
    main(*sys.argv[1:])
