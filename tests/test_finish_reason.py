"""One finish-reason enum end to end (issue 21, 4): the engine's reason travels as its string value,
comes back as the enum, an unknown one is refused, and each API spells it from one table."""

from __future__ import annotations

import pytest

from baton.common import protocol
from baton.common.finish_reason import WIRE_REASONS, FinishReason
from gateway.finish import SPELLING, spelled


@pytest.mark.parametrize("reason", sorted(WIRE_REASONS))
def test_a_finish_reason_crosses_the_wire_as_its_value_and_comes_back_as_the_enum(reason):
    event = protocol.TokenEvent("r", 3, [7], [-0.5], finish_reason=reason)
    assert protocol.decode(protocol.encode(event)).finish_reason is reason
    [batched] = protocol.decode(protocol.encode_token_batch([event])).events
    assert batched.finish_reason is reason
    assert str(reason) == reason.value  # logs and metric labels read "stop", not "FinishReason.STOP"


@pytest.mark.parametrize("value", ["handoff", "stop_sequence", "eos", "STOP", 3])
def test_a_reason_no_worker_sends_is_a_malformed_message(value):
    with pytest.raises(protocol.MalformedMessage, match="finish_reason"):
        protocol.decode(protocol.encode(protocol.TokenEvent("r", 0, [1], [0.0], finish_reason=value)))


def test_each_api_spells_every_normal_end_from_one_table():
    assert {r for r in FinishReason if r.ended_normally} == set(SPELLING)
    assert [spelled(r, "openai") for r in (FinishReason.STOP, FinishReason.STOP_SEQUENCE, FinishReason.LENGTH)] \
        == ["stop", "stop", "length"]
    assert [spelled(r, "tgi") for r in (FinishReason.STOP, FinishReason.STOP_SEQUENCE, FinishReason.LENGTH)] \
        == ["eos_token", "stop_sequence", "length"]
    assert spelled(None, "openai") is None
