"""Sign one attestation per data file of a folder (X.jsonl -> X.jsonl.cose, id X), for a demo with many
contributors: what each of them would run with `govtrain attest`, in one process.

    python examples/attest_each.py DIR --key KEY --class C --clip-norm X --noise-multiplier S --eps-budget E
"""

from __future__ import annotations

import argparse
from pathlib import Path

from govtrain.attest.attest import attest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--key", required=True)
    parser.add_argument("--class", dest="data_class", required=True)
    parser.add_argument("--clip-norm", type=float, required=True)
    parser.add_argument("--noise-multiplier", type=float, required=True)
    parser.add_argument("--eps-budget", type=float, required=True)
    parser.add_argument("--glob", default="*.jsonl")
    args = parser.parse_args()
    files = sorted(args.folder.glob(args.glob))
    for path in files:
        signed, _ = attest(path, key=args.key, contributor=f"owner-of-{path.stem}", data_class=args.data_class,
                           clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier,
                           eps_budget=args.eps_budget, contribution_id=path.stem)
        path.with_name(path.name + ".cose").write_bytes(signed)
    print(f"signed {len(files)} attestations ({args.data_class}, C {args.clip_norm:g}, sigma "
          f"{args.noise_multiplier:g}, eps budget {args.eps_budget:g}) in {args.folder}")


if __name__ == "__main__":
    main()
