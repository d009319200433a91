"""One error type per failure a user can act on.

Every `GovtrainError` carries a stable, machine-readable `Code` (printed as
``error[code]: detail``) and belongs to one family whose class fixes the exit
code (docs/design.md §7). Programmer mistakes stay `TypeError` / `RuntimeError`.
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    """Stable error codes. Values are part of the command-line contract: never rename one."""

    # -- configuration and usage (exit 2) -------------------------------------------------
    USAGE = "usage"
    POLICY_UNREADABLE = "policy_unreadable"
    POLICY_INVALID = "policy_invalid"
    BAD_PUBLIC_KEY = "bad_public_key"
    KEY_UNREADABLE = "key_unreadable"
    KEY_PERMISSIONS = "key_permissions"
    KEY_IS_PUBLIC = "key_is_public"  # a public key where a private (signing) key is needed
    KEY_EXISTS = "key_exists"
    KEY_MISMATCH = "key_mismatch"
    KEY_MISSING = "key_missing"
    LEDGER_URL = "ledger_url"
    LEDGER_EXISTS = "ledger_exists"
    LEDGER_MISSING = "ledger_missing"
    LEDGER_NOT_DATABASE = "ledger_not_database"  # the file given as the ledger is no SQLite database
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # the database went away or stayed busy: nothing written; retry later
    WRITE_UNCONFIRMED = "write_unconfirmed"  # the connection died while committing and never came back: look first
    LEDGER_ACCESS_DENIED = "ledger_access_denied"  # the database refused the URL's user or password: not retried
    BAD_ARGUMENT = "bad_argument"
    MODEL_UNREADABLE = "model_unreadable"
    RUN_CONFIG_INVALID = "run_config_invalid"
    PROFILE_UNRESOLVABLE = "profile_unresolvable"  # the model's layout does not support the profile
    PROFILE_OUT_OF_RANGE = "profile_out_of_range"  # a layer or head the model does not have
    PROFILE_UNMATCHED = "profile_unmatched"  # a class whose profile reaches no trainable parameter
    ROUTING_UNCOVERED = "routing_uncovered"  # a trainable parameter no routing hook can privatize
    MECHANISM_UNSUPPORTED = "mechanism_unsupported"  # the training mechanism cannot run this policy's profiles
    FAMILY_NOT_ALLOWED = "family_not_allowed"  # the policy's [floor.families] does not name the privatizer's family
    BELOW_FAMILY_FLOOR = "below_family_floor"  # a run would charge someone below its noise family's floor
    MATERIALIZED_TOO_LARGE = "materialized_too_large"  # a chunk's per-sample gradients over the materialized limit
    UNGOVERNED_BATCH = "ungoverned_batch"  # a batch, loader or training forward govtrain's sampler did not draw
    SAMPLING_MISMATCH = "sampling_mismatch"  # the sampler's rate is not the rate the ledger's spend charged
    BATCH_COUPLED = "batch_coupled"  # an example's gradient depends on the other examples in its batch
    STALE_PARAMETERS = "stale_parameters"  # a privatized gradient the update would not apply to the model
    UNGOVERNED_UPDATE = "ungoverned_update"  # the trained weights moved outside a governed step, or a hyperparameter
    # the update reads (a rate, momentum, betas, weight decay, eps) is not RUN.toml's on the run's schedule
    STEP_FAILED = "step_failed"  # a step raised after its draw: the run in this process stops there
    DIVERGED = "diverged"  # more non-finite units than the opt-in training.unsafe_stop_after_nonfinite_units: stops
    NONFINITE_RELEASE = "nonfinite_release"  # a noised gradient with a nan or inf: refused before .grad (a defect)
    RANK_MISMATCH = "rank_mismatch"  # a rank joined with another config, model, data, ledger or version than the lead's
    RANK_LOST = "rank_lost"  # a rank of the run stopped, failed or never joined: every rank stops (resume to go on)
    GRID_INVALID = "grid_invalid"  # a tuning grid that is unreadable, names a key it may not, or builds a bad trial
    TUNE_EXISTS = "tune_exists"  # the ledger already records a tune with this id
    SELECTION_ADMITTED = "selection_admitted"  # selection (tune's file, a Trainer's evaluation) on admitted rows
    ARTIFACT_UNREADABLE = "artifact_unreadable"  # not an adapter folder govtrain wrote, or one of another format
    BASE_MODEL_MISMATCH = "base_model_mismatch"  # the base model found is not the one the adapter was trained on
    CHARGED_BEFORE = "charged_before"  # a run would charge contributions other runs charged, unconfirmed
    WITHDRAWN_AT_RELEASE = "withdrawn_at_release"  # releasing a run trained on a withdrawn contribution, unconfirmed
    OUTPUT_TAKEN = "output_taken"  # the output folder holds another run's adapter, run state or other files
    CORPUS_CHANGED = "corpus_changed"  # a resume whose surviving units would not keep their identities
    RUN_STATE_UNSAFE = "run_state_unsafe"  # a run state not read: a link, not ours, not 0600, or pickled (run-state.pt)
    RUN_STATE_INVALID = "run_state_invalid"  # a run state file that is not one govtrain wrote in its format
    INFERENCE_POLICY_UNREADABLE = "inference_policy_unreadable"  # inference.toml cannot be read or is no TOML
    INFERENCE_POLICY_INVALID = "inference_policy_invalid"  # inference.toml's fields (one line names each)
    # privatizers (docs/privatizers.md)
    PRIVATIZER_UNKNOWN = "privatizer_unknown"  # [noise] privatizer (or a record) names none this installation has
    PRIVATIZER_INVALID = "privatizer_invalid"  # [noise] parameters (or a record) the named privatizer refuses
    PRIVATIZER_UNSUPPORTED = "privatizer_unsupported"  # the mechanism or router cannot run with this privatizer

    # -- encoding: the strict deterministic-CBOR decoder (docs/design.md §2) ----------------------
    TOO_LARGE = "too_large"
    MALFORMED_CBOR = "malformed_cbor"
    TRAILING_BYTES = "trailing_bytes"
    INDEFINITE_LENGTH = "indefinite_length"
    NON_CANONICAL = "non_canonical"
    DUPLICATE_KEY = "duplicate_key"
    FLOAT_FORBIDDEN = "float_forbidden"
    FORBIDDEN_TAG = "forbidden_tag"
    TOO_DEEP = "too_deep"
    INVALID_UTF8 = "invalid_utf8"

    # -- schema of a decoded structure ----------------------------------------------------
    UNKNOWN_FIELD = "unknown_field"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    BAD_VALUE = "bad_value"
    UNSUPPORTED_VERSION = "unsupported_version"

    # -- COSE_Sign1 envelope (docs/design.md §3, RFC 9052 §4.2) -----------------------------------
    NOT_COSE_SIGN1 = "not_cose_sign1"
    BAD_COSE_STRUCTURE = "bad_cose_structure"
    BAD_ALGORITHM = "bad_algorithm"
    BAD_HEADER = "bad_header"
    DUPLICATE_HEADER = "duplicate_header"
    UNKNOWN_CRITICAL = "unknown_critical"
    MISSING_KID = "missing_kid"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KEY = "unknown_key"
    KEY_NOT_AUTHORIZED = "key_not_authorized"

    # -- admissibility against the policy (docs/design.md §4) -------------------------------------
    UNKNOWN_CLASS = "unknown_class"
    BAD_WINDOW = "bad_window"
    NOT_YET_VALID = "not_yet_valid"
    EXPIRED = "expired"
    WINDOW_TOO_LONG = "window_too_long"
    ISSUED_IN_FUTURE = "issued_in_future"
    BELOW_FLOOR = "below_floor"
    BELOW_CORPUS_FLOOR = "below_corpus_floor"
    BUDGET_ABOVE_MAX = "budget_above_max"

    ATTESTATION_UNREADABLE = "attestation_unreadable"

    # -- the data file the descriptor binds ----------------------------------------------
    DATA_UNREADABLE = "data_unreadable"
    DIGEST_MISMATCH = "digest_mismatch"
    BAD_DATA = "bad_data"
    RECORD_COUNT_MISMATCH = "record_count_mismatch"

    # -- replay against the ledger -------------------------------------------------------
    REPLAY = "replay"
    ID_REUSED = "id_reused"
    DUPLICATE_DATA = "duplicate_data"

    # -- ledger requests that name something unknown or not allowed (exit 3) -------------
    UNKNOWN_CONTRIBUTION = "unknown_contribution"
    ALREADY_WITHDRAWN = "already_withdrawn"
    BUDGET_EXCEEDED = "budget_exceeded"  # a spend that breaks a contribution's signed bounds or budget
    RETENTION_HORIZON = "retention_horizon"
    NO_CHECKPOINT = "no_checkpoint"
    REDACTED = "redacted"
    EPOCH_HELD = "epoch_held"  # another run wrote this ledger epoch's spend: plan the next epoch
    RUN_ID_TAKEN = "run_id_taken"  # another run holds this run id (its lease nonce, or its run state's lock)
    CLOCK_BEHIND = "clock_behind"  # the writer's clock reads earlier than the ledger's last entry
    UNKNOWN_RUN = "unknown_run"  # `govtrain release` names a run the ledger has no run entry for
    TUNE_UNRECORDED = "tune_unrecorded"  # a release of a tune's trial before the ledger records the tune

    # -- split inference (docs/split-inference.md; exit 3, an HTTP status each) -------------------
    SESSION_BUDGET_EXHAUSTED = "session_budget_exhausted"  # the session's epsilon after the request would pass its budget
    SESSION_OWNER_MISMATCH = "session_owner_mismatch"  # the session id belongs to another subject
    BAD_PRIVACY_REQUEST = "bad_privacy_request"  # epsilon, delta, clip norm or a session budget out of range
    SIGMA_MISMATCH = "sigma_mismatch"  # a declared sigma that is not the one (epsilon, delta, clip norm) calibrate to
    BAD_VECTOR = "bad_vector"  # a noised vector of the wrong size, or holding NaN or infinity
    NOISE_IMPLAUSIBLE = "noise_implausible"  # a vector whose norm the declared clip and noise do not explain
    BAD_SPLIT_REQUEST = "bad_split_request"  # a body that is not a split request (JSON, fields, types)
    SPLIT_TRANSPORT = "split_transport"  # the split server could not be reached, or answered no split response
    SPLIT_UNSUPPORTED = "split_unsupported"  # (exit 2) a model whose head does not read one pooled vector

    # -- the inference gate (`govtrain serve`; docs/serving.md; HTTP status: govtrain/serve/app.py) ----------
    RIGHTS_MISSING = "rights_missing"  # a request without a Govtrain-Rights header
    RIGHTS_UNREADABLE = "rights_unreadable"  # a header that is not one base64url token of a size an envelope has
    WRONG_AUDIENCE = "wrong_audience"  # an envelope issued for another deployment
    CLASS_NOT_PERMITTED = "class_not_permitted"  # the release draws on a class the envelope excludes
    SESSION_NOT_COVERED = "session_not_covered"  # a split request on a session the envelope does not name
    RELEASE_TAINTED = "release_tainted"  # contributions the release trained on were withdrawn since it was signed
    TAINT_UNKNOWN = "taint_unknown"  # the ledger could not be read to say whether the release is tainted
    REQUEST_TOO_LARGE = "request_too_large"  # a body over the policy's limit
    BAD_REQUEST = "bad_request"  # a body that is not the route's JSON (syntax, fields, types, NaN, sizes)
    NOT_SERVED = "not_served"  # a route for a task this release is not (generate on a classifier)
    METHOD_NOT_ALLOWED = "method_not_allowed"  # a route asked with a method it does not answer (GET /v1/classify)

    # -- ledger integrity (exit 4) --------------------------------------------------------
    INTEGRITY = "integrity"
    LEAF_HASH_MISMATCH = "leaf_hash_mismatch"
    SEQUENCE_GAP = "sequence_gap"
    BAD_ENTRY = "bad_entry"
    BAD_LEDGER_HEADER = "bad_ledger_header"
    BAD_ADMISSION = "bad_admission"
    INDEX_MISMATCH = "index_mismatch"
    BAD_PROOF = "bad_proof"
    BAD_CHECKPOINT = "bad_checkpoint"
    UNSIGNED_TAIL = "unsigned_tail"
    TRUNCATED = "truncated"
    ROLLBACK = "rollback"
    FORK = "fork"
    BAD_SPEND = "bad_spend"
    BAD_PRIVATIZER = "bad_privatizer"  # a run or spend entry's privatizer record names none known or cannot rebuild it
    BAD_WITHDRAWAL = "bad_withdrawal"
    BAD_SUMMARY = "bad_summary"
    BAD_EPOCH = "bad_epoch"
    BAD_RUN = "bad_run"  # a run entry that repeats a run id or names another lease than the run's spend
    BAD_TUNE = "bad_tune"  # a tune entry whose trials, selection or stated epsilon the ledger does not bear out
    ADAPTER_MISMATCH = "adapter_mismatch"  # an adapter folder that is not what its run entry records
    TIME_REVERSED = "time_reversed"  # an entry's time is earlier than the entry before it
    POLICY_UNAUTHORISED = "policy_unauthorised"  # a policy change no key of the policy before it signed

    # -- release manifests (exit 4; docs/release-manifest.md) ------------------------------------
    BAD_ENVELOPE = "bad_envelope"  # not a DSSE envelope of an in-toto payload, read strictly
    BAD_STATEMENT = "bad_statement"  # not an in-toto Statement v1 with govtrain's release predicate (its schema)
    SUBJECT_MISMATCH = "subject_mismatch"  # an adapter folder whose files are not the manifest's subjects
    PREDICATE_MISMATCH = "predicate_mismatch"  # a predicate field its proven run entry or the ledger contradicts


class GovtrainError(Exception):
    """Base of every error a user can act on."""

    exit_code = 1

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"error[{code.value}]: {detail}")
        self.code = code
        self.detail = detail

    def line(self) -> str:
        """The one-line form printed on stderr."""
        return f"error[{self.code.value}]: {self.detail}"

    def as_json(self) -> dict:
        return {"ok": False, "code": self.code.value, "detail": self.detail}


class ConfigError(GovtrainError):
    """A bad policy, key, argument or ledger location: fix the input and rerun (exit 2)."""

    exit_code = 2


class RejectedError(GovtrainError):
    """The gate refused a contribution, or a request named something unknown (exit 3)."""

    exit_code = 3


class EncodingError(RejectedError):
    """Bytes that are not the deterministic CBOR the format requires."""


class AttestationError(RejectedError):
    """A well-formed encoding that is not an acceptable signed attestation."""


class AdmissionError(RejectedError):
    """A valid attestation that this corpus cannot admit (policy, data or replay)."""


class IntegrityError(GovtrainError):
    """The ledger does not verify (exit 4)."""

    exit_code = 4


class InferenceError(RejectedError):
    """A split-inference request refused: its privacy parameters, its vector or its session's budget (exit 3;
    `govtrain.inference.server.HTTP_STATUS` gives each code's HTTP status)."""


class ServeError(RejectedError):
    """The inference gate refused a request: its rights envelope, what the envelope permits, the release's taint,
    or the request itself (exit 3; govtrain/serve/app.py gives each code's HTTP status)."""
