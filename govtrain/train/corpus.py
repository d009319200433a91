"""The run's corpus by stable identity (docs/privatizers.md#sampling-by-identity): every per-unit decision (the Poisson
uniform, the cyclic part, the examples a drawn contribution brings, the microbatch) is keyed by the unit's identity,
never by its position in the run's corpus, and the run state records what those identities name.

A unit's identity is its contribution's id under privacy_unit = "contribution", and for the example unit its
contribution's id with the row's index within that contribution (`routing.microbatch.example_id`). The index is
stable because a contribution is immutable: its bytes are the ones its signed attestation's digest names, read the
same way under the same config. It is chosen over a digest of the row because two equal rows of one contribution
must stay two units: under one identity they would share one uniform, always join together, and the unit's
sensitivity would double.

A resume rebuilds the corpus from the ledger: withdrawn contributions drop out, contributions admitted while the run
was down join, and neither moves anyone else. What it refuses is a surviving contribution whose rows are not the ones
recorded (`check`): its identities would name other rows than the ones the epoch's draws and charges were made for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from govtrain.errors import Code, ConfigError

__all__ = ["check", "merge", "record"]


def _row(item: Any) -> bytes:
    """An example as the task read it, canonically: its type and its compared fields (a causal-LM example's `where`,
    the file and row it came from, is no part of it: a renamed file holds the same rows)."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        fields = [getattr(item, f.name) for f in dataclasses.fields(item) if f.compare]
        return json.dumps([type(item).__name__, fields], ensure_ascii=False, separators=(",", ":"),
                          default=repr).encode()
    return repr(item).encode()


def record(unit: str, ids: Sequence[str], items: Sequence[Any], owner: Sequence[str],
           data_sha256: Mapping[str, bytes]) -> dict:
    """The run state's record of its corpus (plain JSON data): the privacy unit, and per contribution the digest its
    attestation signed, how many rows were read, and a digest of those rows in order (each row's identity is its
    contribution and its index there)."""
    rows: dict[str, Any] = {c: hashlib.sha256() for c in ids}
    counts = dict.fromkeys(ids, 0)
    for item, cid in zip(items, owner):
        canonical = _row(item)
        rows[cid].update(len(canonical).to_bytes(8, "big") + canonical)
        counts[cid] += 1
    return {"unit": unit, "contributions": {c: {"data_sha256": data_sha256[c].hex(), "rows": counts[c],
                                                "rows_sha256": rows[c].hexdigest()} for c in ids}}


def merge(recorded: Any, current: dict) -> dict:
    """What the state records next: every contribution the run has read so far (a withdrawn one stays recorded; one
    admitted since the start is added), each as `check` found it unchanged."""
    was = recorded.get("contributions") if isinstance(recorded, dict) else None
    contributions = dict(was) if isinstance(was, dict) else {}
    contributions.update(current["contributions"])
    return {"unit": current["unit"], "contributions": dict(sorted(contributions.items()))}


def check(recorded: Any, current: dict, state_path: Path) -> None:
    """Refuse (`corpus_changed`) a resume whose surviving units would not keep their identities: another privacy
    unit, or a contribution recorded in the state whose rows now read differently. A state without the record was
    written by a govtrain that drew by position: its epoch's parts and uniforms would change under this one."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("contributions"), dict) \
            or not recorded["contributions"]:  # a run never records none: it refuses to start with no contribution
        raise ConfigError(Code.CORPUS_CHANGED, f"{state_path} records no corpus identity (an earlier govtrain drew "
                                               "units by their position in the corpus): finish that run with the "
                                               "govtrain that started it, or move the state away and start afresh")
    if recorded.get("unit") != current["unit"]:
        raise ConfigError(Code.CORPUS_CHANGED, f"{state_path} was drawn over the {recorded.get('unit')!r} unit, and "
                                               f"the policy's unit is now {current['unit']!r}: finish the run under "
                                               "its own policy, or move the state away and start afresh")
    for cid, now in sorted(current["contributions"].items()):
        was = recorded["contributions"].get(cid)
        if was is not None and was != now:
            what = ("a record that is no contribution's" if not isinstance(was, dict) else
                    "its data digest" if was.get("data_sha256") != now["data_sha256"] else
                    f"{now['rows']} rows, not the {was.get('rows')} recorded" if was.get("rows") != now["rows"] else
                    "its rows (same count, other content or order)")
            raise ConfigError(Code.CORPUS_CHANGED, f"{state_path}: contribution {cid} reads differently from when the "
                                                   f"run drew it ({what}): its units would not keep their identities; "
                                                   "restore its data as the run read it (and the govtrain that read "
                                                   "it), or move the state away and start afresh")
