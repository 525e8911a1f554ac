"""A generation's lifecycle (gateway.generation): its named states and the moves allowed between them.

Rules of this file:
- Every state says where the request's work is, so that `Generation.close()` can tell from the
  state alone what it owes the workers: a Cancel exactly when they may still be running it
  (SENDING's is sent once the send completes), and nothing once they reported its end.
- A move not in `ALLOWED` raises `IllegalTransition` (a gateway bug, never the client's doing);
  CLOSED is final.

The usual path: CREATED -> QUEUED -> ADMITTED -> SENDING -> SENT -> STREAMING -> an end -> CLOSED.
A choice admitted under its first choice's ticket skips QUEUED; a failed send goes back to ADMITTED
(and a generation failing before it was sent is DROPPED); any state may be closed.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    CREATED = "created"  # validated and tokenized; holds nothing
    QUEUED = "queued"  # waiting for admission: holds a ticket that may still be refused
    ADMITTED = "admitted"  # budget granted (its own ticket or a sibling's), events routed; not sent
    SENDING = "sending"  # its prefill request is on its way to the backend
    SENT = "sent"  # the workers hold it; no event yet
    STREAMING = "streaming"  # its events are arriving
    FINISHED = "finished"  # the workers ended it normally: they hold nothing more
    STOPPED = "stopped"  # we ended it normally (stop string, length cut): the workers may still run it
    FAILED = "failed"  # we gave up on it once sent (timeout, lost events, client not reading): ditto
    DROPPED = "dropped"  # ended in error with nothing at the workers (they reported it, or never had it)
    CLOSED = "closed"  # released (close()); nothing follows


ENDS = {State.FINISHED, State.STOPPED, State.FAILED, State.DROPPED}
ALLOWED: dict[State, set[State]] = {
    State.CREATED: {State.QUEUED, State.ADMITTED, State.CLOSED},  # ADMITTED: under a sibling's ticket
    State.QUEUED: {State.ADMITTED, State.CLOSED},  # refused, timed out or the client left: CLOSED
    State.ADMITTED: {State.SENDING, State.DROPPED, State.CLOSED},
    # back to ADMITTED when the send failed; STREAMING: an answer may overtake the send's own reply
    State.SENDING: {State.SENT, State.ADMITTED, State.STREAMING, State.FAILED, State.CLOSED},
    State.SENT: {State.STREAMING, State.FAILED, State.CLOSED},
    State.STREAMING: {*ENDS, State.CLOSED},
    **{end: {State.CLOSED} for end in ENDS},
    State.CLOSED: set(),
}
# Where the workers may still be running it: leaving these without their end costs a Cancel.
AT_WORKERS = {State.SENDING, State.SENT, State.STREAMING}


class IllegalTransition(AssertionError):
    """A move the state table does not allow: a bug in the gateway, never the client's doing."""


def transition(current: State, to: State, request_id: str) -> State:
    """`to`, if the table allows moving there from `current`; else IllegalTransition."""
    if to not in ALLOWED[current]:
        raise IllegalTransition(f"request {request_id}: {current.name} -> {to.name}")
    return to
