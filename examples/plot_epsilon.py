"""Plot cumulative epsilon per class over training steps, from the ledger alone (no data needed).

    python examples/plot_epsilon.py --ledger sqlite:///./demo-out/ledger.db --out demo-out/epsilon.png

Each `spend` entry is written ahead for one ledger epoch; the plot shows, per class, the largest
cumulative epsilon any of its contributions has been charged, stepping up at the training step where
each epoch starts (the charge precedes its steps), with each class's default budget as a dotted line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402


def series(url: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    with Ledger.open(url) as ledger:
        classes = {row.contribution_id: row.data_class for row in ledger.store.admissions()}
        budgets = {name: c.eps_budget_u / 1e6 for name, c in ledger.policy.classes.items()}
        by_epoch: dict[int, dict[str, float]] = {}
        steps: dict[int, int] = {}
        for stored in ledger.store.entries(kinds=("spend",)):
            if stored.body is None:
                continue
            entry = decode_entry(stored.body, seq=stored.seq, kind="spend")
            name = classes[entry["contribution_id"]]
            epoch = by_epoch.setdefault(entry["epoch"], {})
            epoch[name] = max(epoch.get(name, 0.0), entry["eps_u"] / 1e6)
            steps[entry["epoch"]] = max(steps.get(entry["epoch"], 0), entry["steps"])
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in budgets}
    done, last = 0, {}
    for epoch in sorted(by_epoch):  # charged when the epoch starts, before its steps run
        for name in budgets:
            last[name] = max(last.get(name, 0.0), by_epoch[epoch].get(name, 0.0))
            out[name].append((done, last[name]))
        done += steps[epoch]
    for name in budgets:
        out[name].append((done, last.get(name, 0.0)))
    return out, budgets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data, budgets = series(args.ledger)
    figure, axis = plt.subplots(figsize=(7, 4))
    styles = zip(("tab:blue", "tab:orange", "tab:green", "tab:red"), ("-", "--", ":", "-."))
    for (name, points), (color, line) in zip(sorted(data.items()), styles):
        axis.step([s for s, _ in points], [e for _, e in points], where="post", label=f"{name}", color=color,
                  linestyle=line, linewidth=2)
        axis.axhline(budgets[name], linestyle=(0, (1, 3)), linewidth=0.8, color=color)
    axis.set_xlabel("training step")
    axis.set_ylabel("cumulative ε (largest in class, written ahead)")
    axis.set_title("ε per class, charged as each ledger epoch starts (dotted: budget)", fontsize=10)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: " + ", ".join(f"{n} ε {p[-1][1]:.3f}" for n, p in sorted(data.items())))


if __name__ == "__main__":
    main()
