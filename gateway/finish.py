"""Each API's spelling of how a generation ended: the one table (baton.common.finish_reason has the enum).

A generation that ends normally ends with STOP (EOS or a stop token id), LENGTH (max tokens) or
STOP_SEQUENCE (a stop string, matched here); errors and cancellations are answered as errors, not
as a finish reason.
"""

from __future__ import annotations

from baton.common.finish_reason import FinishReason

SPELLING: dict[FinishReason, dict[str, str]] = {
    FinishReason.STOP: {"openai": "stop", "tgi": "eos_token", "metrics": "stop"},
    FinishReason.STOP_SEQUENCE: {"openai": "stop", "tgi": "stop_sequence", "metrics": "stop"},
    FinishReason.LENGTH: {"openai": "length", "tgi": "length", "metrics": "length"},
}


def spelled(reason: FinishReason | None, api: str) -> str | None:
    """`reason` as `api` ("openai", "tgi", "metrics") writes it; None while running."""
    return None if reason is None else SPELLING[reason][api]
