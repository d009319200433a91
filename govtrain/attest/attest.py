"""The contributor's side: describe a data file or dataset directory and sign the description."""

from __future__ import annotations

import time as _time
from pathlib import Path

from govtrain import units
from govtrain.attest.cose import sign_attestation
from govtrain.attest.descriptor import CONTRIBUTION_ID, Descriptor, new_descriptor
from govtrain.attest.keys import load_private_key
from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.data import inspect_data

DEFAULT_VALID_DAYS = 90


def default_contribution_id(data_sha256: bytes) -> str:
    """Derived from the data, so attesting the same file twice yields the same id (and a replay on admit)."""
    return "sha256-" + data_sha256.hex()[:24]


def attest(
    data: str | Path,
    *,
    key: str | Path,
    contributor: str,
    data_class: str,
    clip_norm: units.Number,
    noise_multiplier: units.Number,
    eps_budget: units.Number,
    valid_days: int = DEFAULT_VALID_DAYS,
    contribution_id: str | None = None,
    now: int | None = None,
) -> tuple[bytes, Descriptor]:
    """Sign an attestation for `data`. Returns the `.cose` bytes and the descriptor they carry.

    Real numbers are rounded toward privacy: the clipping norm and budget down, the noise
    multiplier up.
    """
    private_key = load_private_key(key)
    summary = inspect_data(data, error=ConfigError)
    if summary.problem is not None:
        raise ConfigError(Code.BAD_DATA, summary.problem)
    if summary.records == 0:
        raise ConfigError(Code.BAD_DATA, f"{data} holds no records")
    if not 1 <= valid_days <= 36_500:
        raise ConfigError(Code.BAD_ARGUMENT, "--valid-days must be between 1 and 36500")
    try:
        values = {
            "clip_norm_u": units.clip_norm_u(clip_norm),
            "noise_multiplier_u": units.noise_multiplier_u(noise_multiplier),
            "eps_budget_u": units.eps_budget_u(eps_budget),
        }
    except (TypeError, ValueError) as e:
        raise ConfigError(Code.BAD_ARGUMENT, str(e)) from e
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(Code.BAD_ARGUMENT, f"{name.removesuffix('_u').replace('_', '-')} must be positive "
                                                 "(at least 0.000001)")
    contribution_id = contribution_id or default_contribution_id(summary.sha256)
    if not CONTRIBUTION_ID.fullmatch(contribution_id):
        raise ConfigError(Code.BAD_ARGUMENT, "--id must be 1-128 characters from [A-Za-z0-9._:-]")
    try:
        descriptor = new_descriptor(
            contribution_id=contribution_id,
            contributor=contributor,
            data_class=data_class,
            data_sha256=summary.sha256,
            records=summary.records,
            issued_at=int(_time.time()) if now is None else now,
            valid_seconds=valid_days * 86_400,
            **values,
        )
    except GovtrainError as e:
        raise ConfigError(Code.BAD_ARGUMENT, e.detail) from e
    return sign_attestation(descriptor, private_key), descriptor
