"""A scratch ledger: a fresh ledger to develop a training loop against, so that no real budget pays for it.

    scratch = make_scratch("scratch", source_url="sqlite:///demo-out/ledger.db", data="demo-out/data")
    # train with --ledger scratch.url --key scratch.ledger_key: its spend is charged to the scratch ledger only

It holds what a run needs to behave as it would on the source ledger, and nothing that could pass for it:

- the source's policy (classes, profiles, bounds, accountant, delta, sampling, epoch length), under an origin of
  its own, `scratch.invalid/<source origin>/<random>` (`.invalid` is reserved: no real ledger has it), with keys
  of its own: a ledger key and an attester key generated in `<out>/keys`, the only ones its policy trusts;
- every file of `data` that the source admitted and has not withdrawn, admitted again under the same contribution
  id, class, clipping norm, noise multiplier and budget, in an attestation the scratch attester signs for the
  contributor "scratch" (the source's attestations, its contributors' consent, are not copied);
- no spend, no withdrawal, no run: every contribution's epsilon starts at zero.

Nothing is written to the source ledger, which is opened read-only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from govtrain import units
from govtrain.errors import Code, ConfigError

SCRATCH_DOMAIN = "scratch.invalid"
CONTRIBUTOR = "scratch"


@dataclass(frozen=True, kw_only=True)
class Scratch:
    url: str
    origin: str
    folder: Path
    ledger_key: Path
    attester_key: Path
    source_origin: str
    contributions: tuple[str, ...]  # admitted, by the source's ids
    unmatched: tuple[str, ...]  # data entries that are no admitted, live contribution of the source


def scratch_origin(source_origin: str, token: str) -> str:
    origin = f"{SCRATCH_DOMAIN}/{source_origin}/{token}"
    return origin if len(origin) <= 255 else f"{SCRATCH_DOMAIN}/{token}"


def make_scratch(out: str | os.PathLike, *, source_url: str, data: str | os.PathLike,
                 now: int | None = None) -> Scratch:
    """Create the scratch ledger of `source_url` for the files of `data` in the new or empty folder `out`
    (module docstring): `out/ledger.db`, `out/keys/ledger.key` and `.pub`, `out/keys/attester.key` and `.pub`,
    and `out/attestations/<id>.cose`. Refuses (`bad_argument`) a folder that is not empty and a data folder with
    no file the source admitted."""
    from govtrain.attest.attest import attest
    from govtrain.attest.keys import generate_key_pair, load_public_key
    from govtrain.data import read_data
    from govtrain.gate.admission import admit
    from govtrain.ledger.ledger import Ledger
    from govtrain.policy.model import Attester, LedgerKey
    from govtrain.resolver.plan import read_corpus

    now = int(time.time()) if now is None else now
    folder, data_dir = Path(out), Path(data)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(Code.BAD_ARGUMENT, f"--out {folder} exists and is not an empty folder: a scratch ledger is "
                                             "made afresh; give a new folder")
    if not data_dir.is_dir():
        raise ConfigError(Code.BAD_ARGUMENT, f"--data {data_dir} is not a folder")
    with Ledger.open(source_url) as source:
        policy = source.policy
        admitted, withdrawn, _ = read_corpus(source)
    live = {a.data_sha256: (cid, a) for cid, a in admitted.items() if cid not in withdrawn}
    matched: list[tuple[Path, str, object]] = []
    unmatched: list[str] = []
    for path in sorted(data_dir.iterdir()):
        if path.suffix == ".cose" or not (path.is_file() or path.is_dir()):
            continue
        try:
            digest = read_data(path, error=ConfigError).sha256
        except ConfigError:
            unmatched.append(path.name)
            continue
        if digest in live:
            matched.append((path, *live.pop(digest)))
        else:
            unmatched.append(path.name)
    if not matched:
        raise ConfigError(Code.BAD_ARGUMENT, f"--data {data_dir}: no file in it is a contribution {policy.origin} "
                                             "admitted and has not withdrawn; give the folder of the run's "
                                             "training.data")

    keys = folder / "keys"
    ledger_key, ledger_pub = generate_key_pair(keys, "ledger")
    attester_key, attester_pub = generate_key_pair(keys, "attester")
    origin = scratch_origin(policy.origin, os.urandom(4).hex())
    scratch_policy = dataclasses.replace(
        policy, origin=origin, _digest=b"",
        attesters=(Attester(name="scratch-attester", public_key=load_public_key(attester_pub),
                            classes=frozenset(policy.classes)),),
        ledger_keys=(LedgerKey(name=origin, public_key=load_public_key(ledger_pub)),)).validate(ConfigError)
    url = f"sqlite:///{(folder / 'ledger.db').resolve()}"
    # No policy file: the header's source digest is the canonical policy record's own.
    Ledger.init(url, scratch_policy, scratch_policy.digest(), key_path=ledger_key, now=now).close()
    days = max(1, min(30, policy.max_validity_s // 86_400))
    attestations = folder / "attestations"
    attestations.mkdir()
    admitted_ids = []
    with Ledger.open(url, key=ledger_key) as ledger:
        for path, cid, record in matched:
            member = record.member  # type: ignore[attr-defined]
            cose, _ = attest(path, key=attester_key, contributor=CONTRIBUTOR, data_class=member.data_class,
                             clip_norm=units.format_micro(member.clip_norm_u),
                             noise_multiplier=units.format_micro(member.noise_multiplier_u),
                             eps_budget=units.format_micro(member.eps_budget_u), valid_days=days,
                             contribution_id=cid, now=now - 60)
            (attestations / f"{cid}.cose").write_bytes(cose)
            admit(ledger, cose, path, now=now)
            admitted_ids.append(cid)
    return Scratch(url=url, origin=origin, folder=folder, ledger_key=ledger_key, attester_key=attester_key,
                   source_origin=policy.origin, contributions=tuple(admitted_ids), unmatched=tuple(unmatched))
