"""The inference gate as a library: `Gate.start` checks and loads what it serves; each method answers one request.
The HTTP routes (`app.py`) only parse, call these and map a `GovtrainError`'s code to its status.

Start-up, in order, refusing before anything is served (exit 2 from `govtrain serve`):
  1. the inference policy (`policy.py`);
  2. the release manifest verifies under the pinned release key and ledger keys (`release.verification`);
  3. the adapter folder holds exactly the release's subjects: every file is read once, hashed, compared, and the
     bytes that matched are written to a private folder, which is what is loaded (`subject_mismatch` otherwise: an
     operator cannot serve another adapter, nor swap a file after the check);
  4. the model: that folder on its base model, whose tree hash its govtrain.json binds (`govtrain.load`: the base
     is copied to a private folder as it is hashed, loaded from there, and held in memory, not mapped from a file);
  5. the gate's SQLite store: session budgets, and what the gate has seen of its ledger (`memory.LedgerMemory`);
  6. the release's taint, read from the policy's ledger once (a ledger that cannot be read, or that is behind or
     beside what this store has seen, stops the start);
  7. the split head where the release is a classifier that pools one vector.

A request, in order: the rights envelope (`rights.py`: 401), the release's taint (`gate.TaintWatch`: 409 or 503),
what the envelope permits of the release (`gate.decide`: 403, or adapters disabled), then the route's own checks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from govtrain.errors import Code, ConfigError, GovtrainError, ServeError
from govtrain.serve.gate import Decision, TaintReading, TaintWatch, decide, describe_failure
from govtrain.serve.memory import LedgerMemory, SeenWithdrawal
from govtrain.serve.policy import InferencePolicy
from govtrain.serve.rights import VerifiedRights, from_header, verify_rights

MAX_RELEASE_BYTES = 16 << 20
INFO_TAINT_AGE_S = 10  # GET /v1/info (no envelope) reads the ledger at most this often, whatever taint_check_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """A request the gate lets through: who asks, what it is served with, and the taint reading it was served on."""

    rights: VerifiedRights
    decision: Decision
    taint: TaintReading


def snapshot_adapter(folder: Path, subjects: dict[str, str], into: Path) -> None:
    """Step 3: copy `folder` into `into`, every file's bytes read once and compared with the release's `subjects`
    (relative path -> SHA-256 hex) before they are written; `subject_mismatch` unless the two hold exactly the
    same files with the same bytes."""
    if not folder.is_dir():
        raise ConfigError(Code.SUBJECT_MISMATCH, f"--adapter {folder} is not a folder")
    found: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ConfigError(Code.SUBJECT_MISMATCH, f"{path}: a link or special file; a released adapter folder "
                                                     "holds plain files only")
        if path.is_file():
            found[name] = path.read_bytes()
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in found.items()}
    changed = sorted(n for n in subjects.keys() & digests.keys() if subjects[n] != digests[n])
    missing, extra = sorted(subjects.keys() - digests.keys()), sorted(digests.keys() - subjects.keys())
    if changed or missing or extra:
        parts = [f"{label}: {', '.join(names[:5])}" for label, names in
                 (("changed", changed), ("missing", missing), ("not in the release", extra)) if names]
        raise ConfigError(Code.SUBJECT_MISMATCH, f"{folder} is not the adapter the release signs "
                                                 f"({'; '.join(parts)}): serve the released folder")
    for name, data in found.items():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


class Gate:
    """A release being served. Build it with `Gate.start`; `close` it (the private adapter copy is deleted)."""

    def __init__(self, *, policy: InferencePolicy, envelope: bytes, report: Any, loaded: Any, head: Any,
                 store: Any, memory: LedgerMemory, taint: TaintWatch, clock: Callable[[], float],
                 snapshot: Path) -> None:
        self.policy, self.envelope, self.report = policy, envelope, report
        self.loaded, self.head, self.store, self.memory = loaded, head, store, memory
        self.taint, self._clock, self._snapshot = taint, clock, snapshot
        self._issuers = policy.issuers_by_kid()
        self._model_lock = threading.Lock()  # one forward at a time: the active adapters are the model's state
        self._active: tuple[str, ...] = tuple(report.statement.predicate.adapter.adapters)

    @property
    def predicate(self) -> Any:
        return self.report.statement.predicate

    @property
    def withdrawn_at_release(self) -> list[str]:
        """The contributions the release's run trained on that were withdrawn before it was signed (its predicate
        states them, checked against the ledger): they taint it as a withdrawal since would."""
        return [w.contribution_id for w in self.predicate.withdrawn]

    @property
    def task(self) -> str:
        return self.predicate.adapter.task

    @classmethod
    def start(cls, release: str | os.PathLike[str], adapter: str | os.PathLike[str], policy: InferencePolicy, *,
              base: str | os.PathLike[str] | None = None, device: str = "cpu",
              clock: Callable[[], float] = time.time) -> "Gate":
        """Steps 2-6 of the module's docstring, for the release file `release` and the folder `adapter`."""
        from govtrain.inference.budget import SessionStore
        from govtrain.release.load import load
        from govtrain.release.verification import verify_release

        # 2.
        envelope = _read_release(Path(release))
        try:
            report = verify_release(envelope, release_key=policy.release_key, ledger_keys=list(policy.ledger_keys))
        except GovtrainError as e:  # a manifest this deployment cannot serve: a start-up refusal, like a bad config
            raise ConfigError(e.code, f"{release}: {e.detail}") from e
        snapshot = Path(tempfile.mkdtemp(prefix="govtrain-serve-"))  # 0700: only this user reads the copy
        try:
            # 3.
            snapshot_adapter(Path(adapter), dict(report.subjects), snapshot)
            # 4.
            loaded = load(snapshot, base=base, device=device)
            p = report.statement.predicate
            if list(loaded.record.adapters) != list(p.adapter.adapters) or loaded.record.task != p.adapter.task \
                    or loaded.record.base_model.sha256 != p.base_model.sha256:
                raise ConfigError(Code.SUBJECT_MISMATCH, f"{adapter}: its govtrain.json does not state the adapters, "
                                                         "task and base model the release's predicate states")
            # 5.
            policy.session_store.parent.mkdir(parents=True, exist_ok=True)
            store = SessionStore(policy.session_store, now=clock)
            try:
                memory = LedgerMemory(policy.session_store)
            except BaseException:
                store.close()
                raise
            # 6.
            taint = TaintWatch(_taint_reader(envelope, policy, memory), ttl_s=policy.taint_check_s,
                               grace_s=policy.grace_s, clock=clock)
            try:
                taint.reading()
            except ServeError as e:
                store.close()
                memory.close()
                raise ConfigError(e.code, f"the inference policy's ledger: {taint.failure or e.detail}") from e
            # 7.
            head = _split_head(loaded)
        except BaseException:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
        return cls(policy=policy, envelope=envelope, report=report, loaded=loaded, head=head, store=store,
                   memory=memory, taint=taint, clock=clock, snapshot=snapshot)

    def close(self) -> None:
        self.store.close()
        self.memory.close()
        shutil.rmtree(self._snapshot, ignore_errors=True)

    # -- every request ------------------------------------------------------------------------------------------

    def admit(self, header: str | None) -> Admission:
        """The rights envelope in `header` verified, the release's taint checked, the adapters decided."""
        rights = verify_rights(from_header(header), issuers=self._issuers, audience=self.policy.audience,
                               now=int(self._clock()), clock_skew_s=self.policy.clock_skew_s,
                               max_validity_s=self.policy.max_rights_s)
        taint = self.taint.check()
        return Admission(rights=rights, decision=decide(self.predicate, rights.classes), taint=taint)

    def served(self, admission: Admission) -> dict:
        """What a response states about how it was served."""
        d = admission.decision
        return {"release": self.report.release_sha256.hex(), "subject": admission.rights.subject,
                "adapters": list(d.active_adapters), "disabled_adapters": list(d.disabled_adapters),
                "excluded_classes": list(d.excluded_classes), "tainted": admission.taint.tainted,
                "grace_until": self.taint.grace_until(admission.taint),
                "withdrawn_at_release": self.withdrawn_at_release}

    def _forward(self, active: tuple[str, ...], run: Callable[[], Any]) -> Any:
        with self._model_lock:
            if active != self._active:
                self.loaded.model.base_model.set_adapter(list(active))
                self._active = active
            return run()

    def _serves(self, task: str, route: str) -> None:
        if self.task != task:
            raise ServeError(Code.NOT_SERVED, f"{route} serves a {task} release; this one is a {self.task}")

    # -- routes -------------------------------------------------------------------------------------------------

    def classify(self, header: str | None, texts: Sequence[str]) -> dict:
        """Labels and logits of `texts` from the released classifier, with the adapters the envelope allows."""
        admission = self.admit(header)
        self._serves("sequence-classification", "POST /v1/classify")
        self._check_texts(texts)
        logits = self._forward(admission.decision.active_adapters, lambda: self.loaded.logits(list(texts)))
        names = self.loaded.record.id2label
        rows = logits.double().cpu().tolist()
        return {"ok": True, "results": [{"label": names[str(i)], "label_id": i, "logits": row}
                                        for row in rows for i in (max(range(len(row)), key=row.__getitem__),)],
                **self.served(admission)}

    def generate(self, header: str | None, prompt: str, max_new_tokens: int) -> dict:
        """A greedy continuation of `prompt` from the released causal LM, with the adapters the envelope allows."""
        admission = self.admit(header)
        self._serves("causal-lm", "POST /v1/generate")
        self._check_texts([prompt])
        if not 1 <= max_new_tokens <= self.policy.max_new_tokens:
            raise ServeError(Code.BAD_REQUEST, f"max_new_tokens must be 1 to {self.policy.max_new_tokens}")
        text = self._forward(admission.decision.active_adapters, lambda: self._greedy(prompt, max_new_tokens))
        return {"ok": True, "text": text, **self.served(admission)}

    def _greedy(self, prompt: str, max_new_tokens: int) -> str:
        import torch

        tokenizer, model = self.loaded.tokenizer, self.loaded.model
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=True).to(next(model.parameters()).device)
        room = getattr(model.config, "max_position_embeddings", None)
        if room is not None and inputs["input_ids"].shape[1] + max_new_tokens > room:
            raise ServeError(Code.BAD_REQUEST, f"the prompt's {inputs['input_ids'].shape[1]} tokens and "
                                               f"{max_new_tokens} new ones exceed the model's {room} positions")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def split(self, header: str | None, body: bytes) -> tuple[dict, Admission]:
        """The released head on a noised pooled vector (`govtrain.inference`), charged to the caller's session."""
        from govtrain.inference.mechanism import SessionBudget
        from govtrain.inference.server import serve_split
        from govtrain.inference.wire import parse_split_request

        admission = self.admit(header)
        if self.head is None:
            raise ServeError(Code.NOT_SERVED, "POST /v1/split serves a classifier whose head reads one pooled vector; "
                                              f"this release is a {self.task} without one")
        request = parse_split_request(body)
        if request.session_id not in admission.rights.rights.sessions:
            raise ServeError(Code.SESSION_NOT_COVERED, f"your rights envelope does not cover session "
                                                       f"{request.session_id!r}: ask its issuer for one that names it")
        self._check_privacy(request)
        budget = SessionBudget(epsilon_u=self.policy.session_epsilon_u, delta_p=self.policy.session_delta_p)
        # The head is the default adapter's, whichever class adapters are active: no model lock, so that concurrent
        # requests meet in the store's one-transaction debit. The owner is (issuer key, subject): an issuer's
        # subject names are its own, so a second issuer's "alice" can neither spend nor read the first's.
        response = serve_split(self.head, request, self.store, owner=admission.rights.owner, budget=budget)
        return response.model_dump(mode="json"), admission

    def _check_privacy(self, request: Any) -> None:
        """The policy's bounds on one request: epsilon in [min, max], delta at most max, C the policy's."""
        from govtrain import units
        from govtrain.inference.mechanism import release_for

        p = self.policy
        release = release_for(request.epsilon, request.delta, request.clip_norm)  # ranges and rounding, as charged
        problems = []
        if not p.min_epsilon_u <= release.epsilon_u <= p.max_epsilon_u:
            problems.append(f"epsilon {request.epsilon:g} is outside [{units.format_micro(p.min_epsilon_u)}, "
                            f"{units.format_micro(p.max_epsilon_u)}]")
        if release.delta_p > p.max_delta_p:
            problems.append(f"delta {request.delta:g} exceeds {p.max_delta_p / units.PICO:g}")
        if release.clip_norm_u != p.clip_norm_u:
            problems.append(f"clip_norm {request.clip_norm:g} is not the policy's {units.format_micro(p.clip_norm_u)}")
        if problems:
            raise ServeError(Code.BAD_PRIVACY_REQUEST, f"{'; '.join(problems)} (this deployment's inference policy)")

    def _check_texts(self, texts: Sequence[str]) -> None:
        if not 1 <= len(texts) <= self.policy.max_texts:
            raise ServeError(Code.BAD_REQUEST, f"give 1 to {self.policy.max_texts} texts, not {len(texts)}")
        longest = max(len(t) for t in texts)
        if longest > self.policy.max_text_chars:
            raise ServeError(Code.REQUEST_TOO_LARGE, f"a text of {longest} characters; at most "
                                                     f"{self.policy.max_text_chars}")

    def info(self) -> dict:
        """What is served: the release, its classes and groups, its taint (no envelope needed: the taint it shows is
        at most `INFO_TAINT_AGE_S` old, or `taint_check_seconds` where that is longer, so that this route never
        reads the ledger more often than that)."""
        p = self.predicate
        try:
            reading: TaintReading | None = self.taint.reading(
                max_age_s=max(self.policy.taint_check_s, INFO_TAINT_AGE_S))
            taint: dict = {"tainted": reading.tainted, "withdrawn_since": list(reading.withdrawn),
                           "withdrawn_at_release": list(reading.at_release),
                           "since": reading.since, "checked_at": reading.checked_at,
                           "grace_until": self.taint.grace_until(reading)}
        except ServeError as e:
            taint = {"tainted": None, "error": e.as_json()}
        return {
            "ok": True, "release": self.report.release_sha256.hex(), "run_id": p.run.run_id, "origin": p.ledger.origin,
            "task": self.task, "base_model": p.base_model.model_dump(mode="json"),
            "adapters": list(p.adapter.adapters), "delta_p": p.privacy.delta_p,
            "withdrawn_at_release": [{"contribution_id": w.contribution_id, "data_class": w.data_class, "seq": w.seq}
                                     for w in p.withdrawn],
            "classes": {c.data_class: {"eps_u": c.eps_u, "contributions": c.contributions, "adapter": c.adapter,
                                       "groups": list(c.groups)} for c in p.classes},
            "routes": ["/v1/info", "/v1/classify" if self.task == "sequence-classification" else "/v1/generate",
                       *(["/v1/split"] if self.head is not None else [])],
            "audience": self.policy.audience, "taint": taint,
            "split": None if self.head is None else {
                "clip_norm_u": self.policy.clip_norm_u, "min_epsilon_u": self.policy.min_epsilon_u,
                "max_epsilon_u": self.policy.max_epsilon_u, "max_delta_p": self.policy.max_delta_p,
                "session_epsilon_u": self.policy.session_epsilon_u, "session_delta_p": self.policy.session_delta_p},
        }


def _read_release(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_RELEASE_BYTES + 1)
    except OSError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot read the release manifest {path}: {e.strerror}") from e
    if len(raw) > MAX_RELEASE_BYTES:
        raise ConfigError(Code.BAD_ARGUMENT, f"{path} is over {MAX_RELEASE_BYTES >> 20} MiB: no release manifest")
    return raw


def _taint_reader(envelope: bytes, policy: InferencePolicy,
                  memory: LedgerMemory | None = None) -> Callable[[int], TaintReading]:
    """Reads the withdrawals of what the release trained on from the policy's ledger (the release verified against
    it again: its checkpoint must be one the live ledger extends), held against what `memory` has seen (None: a
    memory of this reader's own life): the ledger's verified tree may not be smaller than, or other than an
    extension of, the largest one seen, and the withdrawals are those read now and every one read before, a
    sighting in an unsigned tail until a signed checkpoint settles it (`memory.py`). Those withdrawn before the
    release (the predicate states them) taint it as those since do (seed 004: signing the same adapter again is no
    retraining). A withdrawal's time is its entry's body's (never the database's column; where retention dropped
    the body, the last kept body's before it, a signed lower bound), and never later than when the memory first
    saw that entry."""
    memory = memory if memory is not None else LedgerMemory()

    def read(now: int) -> TaintReading:
        from govtrain.ledger.ledger import Ledger
        from govtrain.ledger.merkle import MerkleTree
        from govtrain.release.verification import verify_release

        try:
            with Ledger.open(policy.ledger_url) as ledger:
                report = verify_release(envelope, release_key=policy.release_key,
                                        ledger_keys=list(policy.ledger_keys), ledger=ledger)
                current = report.current_checkpoint
                # the time its body states; a body retention retired: the last kept body's before it (`facts.py`)
                found = [SeenWithdrawal(contribution_id=w.contribution_id, seq=w.seq, leaf_hash=w.leaf_hash,
                                        time=w.time) for w in (*report.withdrawn_at_release,
                                                               *(report.withdrawn_since or ()))]
                leaves = report.leaves
                tree = MerkleTree(leaves, current.size)
                seen = memory.advance(origin=report.origin, size=current.size, root=current.root,
                                      consistency=lambda old: tree.consistency_proof(old, current.size),
                                      release_sha256=report.release_sha256, withdrawals=found, now=now,
                                      leaves=leaves)
        except GovtrainError:
            raise
        except Exception as e:  # a driver's own words may quote its connection string: the password goes
            raise ServeError(Code.TAINT_UNKNOWN, _without_password(describe_failure(e), policy.ledger_url)) from None
        signed_at = report.checkpoint.size  # the release's checkpoint: entries before it were withdrawn at release
        return TaintReading(withdrawn=tuple(dict.fromkeys(w.contribution_id for w in seen if w.seq >= signed_at)),
                            at_release=tuple(dict.fromkeys(w.contribution_id for w in seen if w.seq < signed_at)),
                            since=min(w.time for w in seen) if seen else None, checked_at=now)

    return read


def _without_password(text: str, url: str) -> str:
    from sqlalchemy.engine import make_url

    from ledger_store import redacted_url

    text = text.replace(url, redacted_url(url))
    try:
        password = make_url(url).password
    except Exception:  # not a URL SQLAlchemy reads: Ledger.open refused it in words of its own
        return text
    return text.replace(str(password), "***") if password else text


def _split_head(loaded: Any) -> Any:
    """The split head, or None where the release cannot serve split inference (a causal LM, a head that reads
    more than one pooled vector)."""
    from govtrain.inference.server import SplitHead

    try:
        return SplitHead(loaded)
    except GovtrainError as e:
        if e.code is Code.SPLIT_UNSUPPORTED:
            return None
        raise
