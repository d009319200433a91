"""The inference gate (`govtrain serve`): a release served only as its rights allow (docs/serving.md).

    rights.py    rights envelopes: the COSE_Sign1 claims a caller carries (subject, classes, sessions); issue, verify
    policy.py    inference.toml: issuers, the pinned release and ledger keys, taint grace, session budgets, limits
    gate.py      the decisions: which adapters a caller is served with (or 403), and the release's taint (409)
    service.py   `Gate`: start-up checks (release, adapter files, model, ledger), one method per route
    app.py       the FastAPI app and its uvicorn server: thin routes, one code-to-status table

Importing this package imports neither torch nor FastAPI.
"""

from govtrain.serve.rights import HEADER, Rights, VerifiedRights, from_header, issue_rights, to_header, verify_rights

__all__ = ["HEADER", "Rights", "VerifiedRights", "from_header", "issue_rights", "to_header", "verify_rights"]
