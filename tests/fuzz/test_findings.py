"""Every finding's reproducer, through the target that found it: now one coded error (tests/fuzz/findings.py)."""

from __future__ import annotations

import pytest

from tests.fuzz import test_config, test_data, test_encoding, test_ledger, test_serve_release
from tests.fuzz.common import check
from tests.fuzz.findings import findings
from tests.fuzz.world import world

TARGETS = {t.name: t for m in (test_encoding, test_ledger, test_config, test_data, test_serve_release)
           for t in m.TARGETS}


@pytest.mark.parametrize("number", range(1, 22))
def test_finding_is_a_coded_error(number: int) -> None:
    finding = findings(world().checkpoint)[number - 1]
    assert finding.number == number
    error = check(lambda: TARGETS[finding.target].run(finding.data))
    assert error is not None and error.code is finding.code, finding.was
