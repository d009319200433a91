"""Finishing a run (`train/run.py`): save the adapter, record the run entry, write the card, remove the state.

A run that recorded its entry before a kill saves and records nothing again: its folder must still hash to the
recorded adapter, and only the card and the state's removal are done. The lead alone does this; `Run.finish` hands
the other ranks the adapter's hash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from govtrain.errors import GovtrainError
from govtrain.train.lease import LOCK_FILE
from govtrain.train.resume import read_recorded_adapter
from govtrain.train.state import RunResult


def finish(run, check: Callable[[Path], None] | None) -> RunResult:
    """(The lead's.) What `Run.finish` says, on the lead: save, record, write the card, remove the state."""
    from govtrain.release.artifact import adapter_sha256

    run._check_owner()
    output = run.config.output_dir
    result = run.result
    if not run.recorded:  # the schedule the steps followed, which RUN.toml's hash does not cover
        run.export.fix_schedule(run.update.hyperparameters.schedule.record())
    record = run.export.record
    if run.recorded:  # the adapter was saved and recorded before a kill: it must still be what was recorded
        result.adapter_sha256, record = read_recorded_adapter(output, run._entry)
    else:
        output.mkdir(parents=True, exist_ok=True)
        # sharded: the weights as gathered after the last step (the lead alone writes; nothing here is a collective)
        run.model.save_pretrained(output, **({"state_dict": run._whole["trainable"]} if run.sharded else {}))
        run.export.write(output)
        if check is not None:
            check(output)
        result.adapter_sha256 = adapter_sha256(output)  # every file but the card, which cites the run entry
        device = run.device.type if run.device.type == "cpu" else str(run.device)
        run.ledger.record_run(result.run_id, run.config.file.training.mechanism, run.config.sha256,
                               run.base_sha256, result.adapter_sha256, run_nonce=run.run_nonce, device=device,
                               precision=run.precision, now=run.now(), privatizer=run.privatizer.record())
    # The card before the state goes: a kill until the state is removed leaves a run that the same config, run
    # again, finishes (`recorded`); after it, the run is whole.
    run._write_card(output, record)
    run.state_path.unlink(missing_ok=True)
    (output / LOCK_FILE).unlink(missing_ok=True)  # the id is spent: no later run can take this state
    return result


def write_card(run, output: Path, record) -> None:  # type: ignore[no-untyped-def]
    """The model card of the adapter whose govtrain.json is `record`, from the ledger as the run entry left it. The
    run is recorded whatever happens here: a card that cannot be written is said, not raised (`verify_adapter`
    checks the adapter without it)."""
    from govtrain.release import card

    try:
        card.write_card(output, record, card.run_facts(run.ledger, run.run_id))
    except (GovtrainError, OSError) as e:
        run.log(f"note: the model card {output / 'README.md'} was not written ({e}); the adapter and its run "
                 "entry are saved")
