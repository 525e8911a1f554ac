"""How a request ended: one enum from the engine, over the wire, to the gateway.

The engine sets it, the workers send it in `TokenEvent.finish_reason` (as its string value: the wire
format is unchanged, and `baton.common.protocol.decode` turns it back into the enum, refusing any other
value), and the gateway adds the one reason only it can see (a stop string: the workers never see
text). Each API's spelling of it is one table, `gateway.finish`.
"""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or one of the request's stop token ids
    LENGTH = "length"  # max_tokens, or the model's length
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (the gateway's)
    CANCELLED = "cancelled"  # aborted: the client left, a stop string, a shutdown
    ERROR = "error"  # with a message (`TokenEvent.error`)
    HANDOFF = "handoff"  # the engine's only: a prefill handed the request on to decode

    # "stop", not "FinishReason.STOP", in logs, metrics labels and f-strings (as Python 3.11's StrEnum)
    __str__ = str.__str__

    @property
    def ended_normally(self) -> bool:
        """The request has its answer (as opposed to being dropped or failing)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_SEQUENCE)


# What a worker may send; HANDOFF and STOP_SEQUENCE never travel.
WIRE_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.ERROR})
