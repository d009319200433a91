"""A search's grid (`govtrain tune`, `tune.py`): the grid file (`[grid]` dotted RUN.toml keys -> lists, `[select]`),
what a grid may not vary (`REFUSED`), and every trial's config built from the base RUN.toml and validated
(`plan_trials`) before anything is trained or written; the metric the trials are selected by.

Kept apart from the search itself: this half only reads and builds configs, and writes nothing.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from govtrain.errors import Code, ConfigError
from govtrain.ledger.tuning import MAX_TRIALS, TUNE_ID, trial_run_id
from govtrain.policy.config import format_errors, read_toml_file
from govtrain.train.config import (
    DataSection,
    LoraSection,
    ModelSection,
    MuonSection,
    OptimizerSection,
    PrismSection,
    RunConfig,
    RunFile,
    TrainingSection,
)

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSection, "data": DataSection, "lora": LoraSection, "optimizer": OptimizerSection,
    "training": TrainingSection, "prism": PrismSection, "muon": MuonSection,
}
# What a grid may not vary, and why: the search is over how one corpus is trained and scored, not which.
REFUSED = {
    "training.run_id": "each trial's run id is <tune_id>-trial-<k>",
    "training.output": "each trial's adapter goes to <training.output>/trial-<k>",
    "training.data": "every trial trains on the same admitted contributions",
    "model.base": "every trial adapts the same base model (the selection compares adapters of one model)",
    "model.task": "every trial has the task the selection metric scores",
    "data.text_column": "every trial reads the same rows", "data.label_column": "every trial reads the same rows",
    "data.prompt_column": "every trial reads the same rows",
    "data.completion_column": "every trial reads the same rows",
    "data.messages_column": "every trial reads the same rows",
    "training.device": "a performance flag, not a hyperparameter: it never changes the mechanism",
    "training.precision": "a performance flag, not a hyperparameter: it never changes the mechanism",
    "training.physical_batch": "a performance flag, not a hyperparameter: it never changes the mechanism",
    "training.compiled": "a performance flag, not a hyperparameter: it never changes the mechanism",
}


class SelectSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data: StrictStr = Field(description="held-out file the trials are scored on; no row of it an admitted "
                                        "contribution's (path relative to the grid file)")
    metric: Literal["accuracy", "loss"] | None = Field(
        None, description="accuracy (higher is better; classification) or loss (lower is better; causal LM); "
                          "default the task's")


class GridFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: dict[StrictStr, Annotated[list[Any], Field(min_length=1)]] = Field(min_length=1)
    select: SelectSection

    @field_validator("grid", mode="before")
    @classmethod
    def _dotted(cls, value: Any) -> Any:
        """`optimizer.lr = [...]` unquoted is a TOML table {optimizer: {lr: [...]}}: read it as "optimizer.lr"."""
        if not isinstance(value, dict):
            return value
        flat: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(item, dict):
                flat.update({f"{key}.{name}": inner for name, inner in item.items()})
            else:
                flat[key] = item
        return flat


@dataclass(frozen=True, kw_only=True)
class Grid:
    file: GridFile
    sha256: bytes
    base: Path  # the folder the grid file is in

    @property
    def selection(self) -> Path:
        path = Path(self.file.select.data)
        return path if path.is_absolute() else self.base / path


@dataclass(frozen=True, kw_only=True)
class Trial:
    index: int
    run_id: str
    values: dict[str, Any]  # the grid point: dotted key -> value
    config: RunConfig
    document: bytes  # the derived config as canonical JSON: what `config.sha256` is the hash of


def load_grid(path: str | Path) -> Grid:
    path = Path(path)
    file, raw = read_toml_file(path, GridFile, what="grid", unreadable=Code.GRID_INVALID, invalid=Code.GRID_INVALID)
    return Grid(file=file, sha256=hashlib.sha256(raw).digest(), base=path.resolve().parent)


def new_tune_id(now: int) -> str:
    return f"tune-{now}-{os.urandom(4).hex()}"


def plan_trials(config: RunConfig, config_path: str | Path, grid: Grid, tune_id: str) -> list[Trial]:
    """Every trial's config, built from the base RUN.toml and validated, before anything is trained or written.
    Refuses (GRID_INVALID) a key the run config does not have or that `REFUSED` names, a list with a value
    twice, more than `MAX_TRIALS` trials, and any trial whose config is invalid."""
    if not TUNE_ID.fullmatch(tune_id) or len(trial_run_id(tune_id, MAX_TRIALS)) > 128:
        raise ConfigError(Code.BAD_ARGUMENT, f"--id {tune_id!r}: 1-100 characters of [A-Za-z0-9._:-]")
    raw = Path(config_path).read_bytes()
    if hashlib.sha256(raw).digest() != config.sha256:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"{config_path} changed while it was being read")
    base = tomllib.loads(raw.decode("utf-8"))
    axes = list(grid.file.grid.items())
    for key, values in axes:
        section, _, name = key.partition(".")
        if key in REFUSED:
            raise ConfigError(Code.GRID_INVALID, f"grid key {key!r} may not vary: {REFUSED[key]}")
        if section not in SECTIONS or name not in SECTIONS[section].model_fields:
            raise ConfigError(Code.GRID_INVALID, f"grid key {key!r} is not a run config setting (section.name, "
                                                 f"e.g. \"optimizer.lr\")")
        try:  # the trials' configs are hashed as JSON: a TOML date or time, NaN or infinity has no JSON form
            canonical = [json.dumps(v, sort_keys=True, allow_nan=False) for v in values]
        except (TypeError, ValueError) as e:
            raise ConfigError(Code.GRID_INVALID, f"grid key {key!r} lists a value that is not a number, string, "
                                                 f"boolean, array or table ({e})") from e
        if len(set(canonical)) != len(canonical):
            raise ConfigError(Code.GRID_INVALID, f"grid key {key!r} lists a value twice: each trial is charged")
    count = 1
    for _, values in axes:
        count *= len(values)
    if count > MAX_TRIALS:
        raise ConfigError(Code.GRID_INVALID, f"the grid has {count} trials; at most {MAX_TRIALS}, each charged")
    output = config.output_dir
    trials = []
    for index, point in enumerate(itertools.product(*(values for _, values in axes))):
        document = copy.deepcopy(base)
        values = dict(zip((key for key, _ in axes), point))
        for key, value in values.items():
            section, _, name = key.partition(".")
            document.setdefault(section, {})[name] = value
        run_id = trial_run_id(tune_id, index)
        document["training"]["run_id"] = run_id
        document["training"]["output"] = str(output / f"trial-{index}")
        try:
            file = RunFile.model_validate(document)
        except ValidationError as e:
            raise ConfigError(Code.GRID_INVALID, f"trial {index} ({shown(values)}): {format_errors(e)}") from e
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        trials.append(Trial(index=index, run_id=run_id, values=values, document=text,
                            config=RunConfig(file, hashlib.sha256(text).digest(), config.base)))
    return trials


def shown(values: dict[str, Any]) -> str:
    return ", ".join(f"{key} = {json.dumps(value)}" for key, value in values.items())


def selection_metric(config: RunConfig, grid: Grid) -> str:
    task = config.file.model.task
    metric = grid.file.select.metric or ("accuracy" if task == "sequence-classification" else "loss")
    if task == "causal-lm" and metric != "loss":
        raise ConfigError(Code.GRID_INVALID, "select.metric: a causal LM is scored by its per-token loss")
    if task == "sequence-classification" and metric != "accuracy":
        raise ConfigError(Code.GRID_INVALID, "select.metric: a classifier is scored by its accuracy")
    return metric
