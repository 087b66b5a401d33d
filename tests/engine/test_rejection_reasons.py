"""One list of rejection reasons: every rejection the engine records is in it."""

from __future__ import annotations

import pytest

from flwr_gsgm.core import CORE_REASONS, INTAKE_REASONS, REASONS, UpdateRejected
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.intake.reply import ReplyRejected
from tests.engine.quadratic_app import make_app
from tests.intake import test_hostile_replies


def test_the_list_is_intake_then_core_without_repeats():
    assert REASONS == INTAKE_REASONS + CORE_REASONS
    assert len(set(REASONS)) == len(REASONS)
    assert UpdateRejected.REASONS == REASONS


def test_every_reason_of_the_hostile_reply_tests_is_in_the_list():
    """The reasons the hostile-reply tests expect, and those its run records."""
    h = test_hostile_replies
    expected = {reason for _, reason in h.KINDS} | {"duplicate"}
    grid = h.ReplayingGrid(make_app(misbehave={h.HOSTILE: h.hostile()}), 4, run_config={})
    recorded = set(h.run(grid).report.rejections)
    assert expected <= recorded  # the run did send every kind
    for seen in (expected, recorded):
        assert seen <= set(REASONS), f"not in flwr_gsgm.core.REASONS: {sorted(seen - set(REASONS))}"


def test_a_reason_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="INTAKE_REASONS"):
        ReplyRejected("shape", "a core reason is not an intake reason")
    with pytest.raises(ValueError, match="REASONS"):
        Ledger().record_rejection("no-such-reason")
