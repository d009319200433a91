"""The run config (RUN.toml) of `govtrain train`, validated by pydantic.

`schemas/run.schema.json` is generated from `RunFile` (`python -m govtrain.train.config --schema`)
and a test keeps the two identical. Paths are relative to the config file. The config's SHA-256
(of its bytes, as read) is what the ledger's `run` entry records.

    [model]
    base = "minilm"              # bundled all-MiniLM-L6-v2; or org/name (local HF cache); or a local directory
    task = "sequence-classification"   # or "causal-lm" (govtrain/tasks/causal_lm.py: rows, targets, padding)
    num_labels = 2               # sequence-classification only
    max_length = 48

    [data]                       # column names of the data rows (these are the defaults)
    text_column = "text"
    label_column = "label"       # sequence-classification
    prompt_column = "prompt"     # causal-lm: {prompt, completion}, or {messages}, or {text}
    completion_column = "completion"
    messages_column = "messages"

    [lora]
    r = 8
    alpha = 16
    target_modules = ["query", "key", "value", "attention.output.dense"]

    [optimizer]
    name = "adamw"               # sgd | adam | adamw
    lr = 5e-4

    [training]
    mechanism = "dpsgd"          # dpsgd | prism | dp-muon
    steps = 300
    expected_batch_size = 32     # only if the policy does not fix the sampling rate
    epoch_steps = 50             # ledger epoch length; at most (and by default) the policy's steps_per_epoch
    data = "data"                # folder of contribution files (JSONL {"text", "label"})
    output = "adapter"           # where the peft adapter is saved
    compiled = false             # performance flag: the clipping stage as a compiled graph (same bits)

    [prism]                      # only with mechanism = "prism": the LoRA pairs' update
    lr = 0.002
    floor = 1.0                  # preconditioner eigenvalue floor, in units of the noise's mean eigenvalue

    [muon]                       # only with mechanism = "dp-muon": the stack's matrices' update
    lr = 0.01
    momentum = 0.9

    [noise]                      # the privatizer (docs/privatizers.md); absent: the i.i.d. Gaussian
    privatizer = "gaussian"      # gaussian | banded-mf | blt | laplace | discrete-gaussian | skellam
    bands = 16                   # banded-mf only
    # buffers = 2, min_separation = 50   blt only: its buffers, and the sampler's cycle
    microbatches = 1             # per-microbatch noise (k > 1: the i.i.d. gaussian only)

With prism or dp-muon, `[optimizer]` moves what those do not: the classifier head, norms, embeddings.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, model_validator

from govtrain.errors import Code, ConfigError
from govtrain.policy.config import format_errors, read_toml_file, schema_of
from govtrain.privatizers import REGISTRY
from govtrain.privatizers.base import FIELDS as PRIVATIZER_FIELDS
from govtrain.privatizers.base import PrivatizerSpec

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(ge=1, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
# A bare "dense" also matches BERT's pooler.dense (and, under SEQ_CLS, nothing useful): name the path.
AMBIGUOUS_TARGETS = frozenset({"dense"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    base: StrictStr = Field(description="'minilm' (bundled), a Hugging Face id (org/name) in the local Hugging Face "
                                        "cache, or a local Hugging Face model directory")
    task: Literal["sequence-classification", "causal-lm"] = Field(
        "sequence-classification", description="sequence-classification: {text, label} rows, a classifier head; "
                                               "causal-lm: {text}, {prompt, completion} or {messages} rows, "
                                               "next-token loss on the target tokens, the model's own LM head")
    num_labels: Annotated[int, Field(ge=2, strict=True)] = Field(2, description="sequence-classification only")
    max_length: Annotated[int, Field(ge=4, le=4096, strict=True)] = 128
    pooling: Literal["model", "mean"] = Field(
        "model", description="model: the architecture's own pooler (BERT: [CLS] -> dense -> tanh); mean: the "
                             "masked mean of the final hidden states, as sentence-transformers models are trained")

    @model_validator(mode="after")
    def _pooling(self) -> "ModelSection":
        if self.task == "causal-lm" and self.pooling != "model":
            raise ValueError("pooling applies to sequence-classification only: a causal LM predicts every next "
                             "token and pools nothing; remove model.pooling")
        if self.task == "causal-lm" and "num_labels" in self.model_fields_set:
            raise ValueError("num_labels applies to sequence-classification only: a causal LM's targets are its "
                             "vocabulary; remove model.num_labels")
        return self


Column = Annotated[StrictStr, Field(min_length=1)]


class DataSection(_Strict):
    """Which columns of a data row the task reads (JSON keys, CSV headers, Parquet or dataset columns)."""

    text_column: Column = "text"
    label_column: Column = "label"
    prompt_column: Column = "prompt"
    completion_column: Column = "completion"
    messages_column: Column = "messages"


class LoraSection(_Strict):
    r: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    target_modules: list[Annotated[StrictStr, Field(min_length=1)]] = Field(
        default_factory=lambda: ["query", "key", "value", "attention.output.dense"], min_length=1,
        description="module name suffixes that get LoRA factors (peft's target_modules)")
    layers: list[Annotated[int, Field(ge=0, strict=True)]] | None = Field(
        None, min_length=1, description="only these transformer layers get LoRA factors (peft's "
                                        "layers_to_transform); absent: every layer. Autograd stops at the "
                                        "lowest layer with a trainable factor, so fewer layers train faster")

    @model_validator(mode="after")
    def _targets(self) -> "LoraSection":
        bare = sorted(AMBIGUOUS_TARGETS.intersection(self.target_modules))
        if bare:
            raise ValueError(f"target {bare[0]!r} also matches pooler.dense; name the path, e.g. "
                             "'attention.output.dense', 'intermediate.dense' or 'output.dense'")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules lists a module twice")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise ValueError("layers lists a layer twice")
        return self


class OptimizerSection(_Strict):
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: PositiveFloat = 5e-4
    head_lr: PositiveFloat | None = Field(
        None, description="learning rate of the trainable parameters outside the layer stack (the classification "
                          "head, what a profile's head = true reaches); absent: lr. A head is a few thousand "
                          "coordinates against the LoRA factors' hundred thousand: under DP noise it can take a "
                          "larger step")
    weight_decay: NonNegativeFloat = 0.0
    momentum: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)

    @model_validator(mode="after")
    def _momentum(self) -> "OptimizerSection":
        if self.momentum and self.name != "sgd":
            raise ValueError("momentum applies to sgd only (adam and adamw use betas)")
        return self


class PrismSection(_Strict):
    lr: PositiveFloat = Field(0.002, description="step size of the retraction on the rank-r manifold")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    floor: NonNegativeFloat = Field(1.0, description="preconditioner eigenvalue floor, in units of the mean "
                                                     "eigenvalue of the DP noise's second moment (0: none)")
    max_condition: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        1e4, description="condition-number cap of the r x r preconditioner")


class MuonSection(_Strict):
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.9
    iteration: Literal["seed", "quintic"] = Field(
        "seed", description="seed: the degree-kappa Newton-Schulz polynomial; quintic: torch.optim.Muon's")
    kappa: Annotated[int, Field(ge=1, le=8, strict=True)] = Field(3, description="degree of the seed's polynomial")
    steps: Annotated[int, Field(ge=1, le=50, strict=True)] | None = Field(
        None, description="Newton-Schulz iterations (default: 6 for seed, torch.optim.Muon's own for quintic)")


class NoiseSection(_Strict):
    """RUN.toml [noise]: which privatizer adds the noise, and its parameters (docs/privatizers.md). Each field
    besides `privatizer` applies to some privatizers only: the privatizer's `from_config` refuses the others
    (`privatizer_invalid`, when the run is prepared)."""

    # The docstring above is schemas/run.schema.json's description, kept as published: its `from_config` is now
    # `Privatizer.from_parameters`, which takes `privatizer_spec()`'s parameters.
    privatizer: Literal[tuple(REGISTRY)] = Field(  # type: ignore[valid-type]
        "gaussian", description="gaussian (i.i.d., DP-SGD's), banded-mf, blt (correlated: matrix factorization), "
                                "laplace, discrete-gaussian, skellam (noise families)")
    bands: PositiveInt | None = Field(None, description="banded-mf: the number of bands b of the strategy matrix")
    buffers: PositiveInt | None = Field(None, description="blt: the number of buffers of the strategy")
    min_separation: PositiveInt | None = Field(
        None, description="blt: the sampler's cycle b; a unit takes part at most once in any b consecutive steps "
                          "(at most training.steps)")
    granularity_bits: Annotated[int, Field(ge=1, le=32, strict=True)] | None = Field(
        None, description="discrete-gaussian, skellam: the quantisation step is 2^-granularity_bits of the clip norm")
    beta_exp: Annotated[int, Field(ge=1, le=64, strict=True)] | None = Field(
        None, description="discrete-gaussian, skellam: randomised rounding is conditioned to fail with "
                          "probability at most 2^-beta_exp")
    microbatches: PositiveInt = Field(
        1, description="per-microbatch noise: each step's units are split into this many microbatches by a public "
                       "rule on their ids, and each microbatch's clipped sum is noised on its own (the same charge; "
                       "k times the noise variance). 1: one noise per step. More than 1 takes the i.i.d. gaussian")

    def privatizer_spec(self) -> PrivatizerSpec:
        """The privatizer's own parameters, from this section: the fields set that parametrise a privatizer
        (`privatizers.base.FIELDS`; the others configure the router). `privatizers.build` takes it (or this
        section, which it asks for it): the config layer builds the privatizer's inputs, never the reverse."""
        params = {k: v for k, v in self.model_dump().items() if k in PRIVATIZER_FIELDS and v is not None}
        return PrivatizerSpec(name=self.privatizer, params=params, microbatches=self.microbatches)


class TrainingSection(_Strict):
    mechanism: Literal["dpsgd", "prism", "dp-muon"] = "dpsgd"
    steps: PositiveInt
    expected_batch_size: PositiveInt | None = Field(
        None, description="expected Poisson batch size; only when the policy does not fix the sampling rate")
    epoch_steps: PositiveInt | None = Field(
        None, description="steps per ledger epoch (spend written ahead, run state saved); at most the policy's "
                          "steps_per_epoch, which is the default")
    data: StrictStr = Field(description="folder of contribution data files, matched to admit entries by SHA-256")
    output: StrictStr = Field(description="folder the peft adapter is saved to")
    run_id: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")] | None = None
    # How the step is computed, never what it releases (docs/design.md §5: hardware never changes the mechanism).
    device: Annotated[StrictStr, Field(pattern=r"^(auto|cpu|cuda|cuda:[0-9]{1,2})$")] = Field(
        "auto", description="auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward and backward under autocast; per-sample norms, clipping, the clipped "
                            "sum and the noise stay fp32")
    physical_batch: PositiveInt | None = Field(
        None, description="largest number of examples per forward/backward pass: a Poisson batch is split into "
                          "chunks of at most this many, their clipped gradients summed, and noise added once per step")
    compiled: StrictBool = Field(
        False, description="run the router's clipping stage as a compiled graph (torch.compile, aot_eager): the "
                           "same released bits as the hooks', computed without walking the router's structure per "
                           "step; the first steps pay for tracing")
    fsdp: StrictBool = Field(
        False, description="shard the model over the run's processes with FSDP2 (fully_shard on each transformer "
                           "block and the root), for models larger than one device: needs several processes "
                           "(--nproc N or torchrun) and mechanism dpsgd; the same released gradient as one process")
    unsafe_stop_after_nonfinite_units: NonNegativeInt | None = Field(
        None, description="UNSAFE, weakens the guarantee (a warning each run): stop the run (error diverged) at the "
                          "step that would take the run's units whose per-sample gradient is non-finite past this "
                          "many. Whether a unit's gradient is finite is private, and the stop (no further epochs, no "
                          "run entry) is public and charged nothing. Unset (the default): never stop; each such unit "
                          "contributes exactly zero and is counted in the operator's step log only")


class RunFile(_Strict):
    model: ModelSection
    data: DataSection = Field(default_factory=DataSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    training: TrainingSection
    prism: PrismSection | None = None
    muon: MuonSection | None = None
    noise: NoiseSection = Field(default_factory=NoiseSection)

    @model_validator(mode="after")
    def _mechanism_sections(self) -> "RunFile":
        mechanism = self.training.mechanism
        for section, owner in (("prism", "prism"), ("muon", "dp-muon")):
            if getattr(self, section) is not None and mechanism != owner:
                raise ValueError(f"[{section}] applies to mechanism = {owner!r} only, and training.mechanism is "
                                 f"{mechanism!r}")
        if self.training.fsdp:  # what runs on FSDP's sharded parameters (docs/distributed.md "Sharded models")
            if mechanism != "dpsgd":
                raise ValueError(f"training.fsdp trains mechanism 'dpsgd' only: {mechanism}'s update works on whole "
                                 "LoRA factors, which FSDP shards; set fsdp = false (data parallelism) for it")
            if self.training.compiled:
                raise ValueError("training.fsdp and training.compiled: the compiled clipping stage is not built for "
                                 "sharded parameters; set one of them false")
            if self.noise.microbatches > 1:
                raise ValueError("training.fsdp and [noise] microbatches > 1 are not tested together; set "
                                 "microbatches = 1 or fsdp = false")
        if mechanism == "prism" and self.prism is None:
            object.__setattr__(self, "prism", PrismSection())
        if mechanism == "dp-muon" and self.muon is None:
            object.__setattr__(self, "muon", MuonSection())
        return self


class RunConfig:
    """A validated run config, its file's SHA-256 and the folder its relative paths start from."""

    def __init__(self, file: RunFile, sha256: bytes, base: Path) -> None:
        self.file, self.sha256, self.base = file, sha256, base

    def path(self, value: str) -> Path:
        path = Path(value)
        return path if path.is_absolute() else self.base / path

    @property
    def data_dir(self) -> Path:
        return self.path(self.file.training.data)

    @property
    def output_dir(self) -> Path:
        return self.path(self.file.training.output)

    @property
    def model_spec(self) -> str:
        """What `[model] base` names: a bundled model's short name, a Hugging Face id (`org/name`, read from the
        local cache) or a local directory (relative to the config's folder); a folder that exists wins."""
        from govtrain.resolver.load import HUB_ID

        base = self.file.model.base
        if (re.fullmatch(r"[a-z0-9-]+", base) or HUB_ID.fullmatch(base)) and not self.path(base).exists():
            return base
        return str(self.path(base))


def load_run_config(path: str | Path) -> RunConfig:
    path = Path(path)
    file, raw = read_toml_file(path, RunFile, what="run config", unreadable=Code.RUN_CONFIG_INVALID,
                               invalid=Code.RUN_CONFIG_INVALID)
    return RunConfig(file, hashlib.sha256(raw).digest(), path.resolve().parent)


def run_config(value: "RunConfig | Mapping[str, Any] | str | os.PathLike[str]", *,
               base: str | os.PathLike[str] | None = None) -> RunConfig:
    """A `RunConfig` from a RUN.toml path, from its contents as a dict (relative paths start at `base`, by
    default the working directory; its SHA-256 is over its canonical JSON), or as given."""
    if isinstance(value, RunConfig):
        return value
    if isinstance(value, (str, os.PathLike)):
        return load_run_config(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"a run config is a RUN.toml path, a dict or a RunConfig, not {type(value).__name__}")
    try:
        file = RunFile.model_validate(value)
        raw = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except ValidationError as e:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"run config: {format_errors(e)}") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"run config: not plain TOML values ({e})") from e
    return RunConfig(file, hashlib.sha256(raw).digest(), Path(base or Path.cwd()).resolve())


def json_schema() -> dict:
    return schema_of(RunFile, "run.schema.json")


if __name__ == "__main__" and sys.argv[1:] == ["--schema"]:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
