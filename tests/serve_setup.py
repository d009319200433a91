"""A served release, for tests/test_serve.py and tests/test_attacks_serve.py: the session's trained run
(`tests/release_setup.py`: public reaches the upper layers and the head, sensitive a band inside them, restricted
its own adapter) released, an inference policy beside it, an issuer key, and a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np

from govtrain.attest.keys import generate_key_pair, load_private_key, public_key_pem
from govtrain.serve.rights import HEADER, issue_rights, to_header
from tests.release_setup import Released
from tests.test_rights import AUDIENCE, write_policy

ALL = ("public", "restricted", "sensitive")
CLIP = 1.0
TEXTS = ["good movie very fun", "awful plot and dull acting", "the film was great", "bad"]


@dataclass
class Deployment:
    """A release, its adapter, an inference policy and an issuer key, all in `root`."""

    released: Released
    root: Path
    envelope: bytes
    policy_path: Path
    clock: list[float] = field(default_factory=lambda: [time.time()])

    @property
    def issuer(self):  # type: ignore[no-untyped-def]
        return load_private_key(self.root / "issuer.key")

    def now(self) -> float:
        return self.clock[0]

    def rights(self, subject: str = "alice", classes=ALL, sessions=("s-1",), *, valid_seconds: int = 3600,
               key=None, now: int | None = None) -> dict[str, str]:
        """Headers carrying a rights envelope signed by the issuer (or `key`)."""
        envelope, _ = issue_rights(key or self.issuer, subject=subject, audience=AUDIENCE, classes=classes,
                                   sessions=sessions, valid_seconds=valid_seconds,
                                   now=int(self.now()) if now is None else now)
        return {HEADER: to_header(envelope)}

    def owner(self, subject: str = "alice", *, key=None) -> str:  # type: ignore[no-untyped-def]
        """The owner the gate binds `subject`'s split sessions to: (the issuer's key id, the subject)."""
        from govtrain.attest.keys import key_id
        from govtrain.serve.rights import session_owner

        public = (key or self.issuer).public_key().public_bytes_raw()
        return session_owner(key_id(public), subject)

    def policy(self) -> Any:
        from govtrain.serve.policy import load_inference_policy

        return load_inference_policy(self.policy_path)

    def start(self, **options) -> Any:  # type: ignore[no-untyped-def]
        from govtrain.serve.service import Gate

        options.setdefault("base", self.released.base)
        options.setdefault("clock", self.now)
        return Gate.start(self.root / "release.dsse", self.released.adapter, self.policy(), **options)

    @contextlib.contextmanager
    def serving(self, **options) -> Iterator[tuple[httpx.Client, Any]]:  # type: ignore[no-untyped-def]
        """A real uvicorn serving the release; yields an httpx client on its base URL, and the gate."""
        from govtrain.serve.app import create_app, running

        gate = self.start(**options)
        try:
            with running(create_app(gate)) as url, httpx.Client(base_url=url, timeout=60) as client:
                yield client, gate
        finally:
            gate.close()


def deploy(released: Released, *, policy_extra: str = "", release_extra: str = "") -> Deployment:
    """`released` released (its manifest signed now), with an inference policy naming a fresh issuer key."""
    root = released.keys
    (root / "release.dsse").write_bytes(released.build())
    generate_key_pair(root, "issuer")
    path = write_policy(root, public_key_pem(load_private_key(root / "issuer.key").public_key()),
                        (root / "release.pub").read_bytes(), (root / "ledger.pub").read_bytes(), ledger=released.url,
                        extra=policy_extra)
    if release_extra:
        text = path.read_text()
        path.write_text(text.replace("[release]\n", f"[release]\n{release_extra}\n"))
    return Deployment(released=released, root=root, envelope=(root / "release.dsse").read_bytes(), policy_path=path)


def split_body(session_id: str, dimension: int, *, epsilon: float = 1.0, delta: float = 1e-8, clip_norm: float = CLIP,
               seed: int = 0, edit: Callable[[dict], None] | None = None) -> bytes:
    """An honest split request's JSON: a random state clipped to C plus the noise its (epsilon, delta) calibrate."""
    import json

    from govtrain.inference.mechanism import add_noise, clip, release_for
    from govtrain.inference.wire import SplitRequest

    rng = np.random.default_rng(seed)
    release = release_for(epsilon, delta, clip_norm)
    vector = add_noise(clip(rng.normal(size=dimension), release.clip_norm), release, rng)
    document = json.loads(SplitRequest.of(session_id, release, vector).model_dump_json())
    if edit is not None:
        edit(document)
    return json.dumps(document).encode()
