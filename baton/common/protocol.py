"""The message contract between gateway, prefill workers and decode workers.

Every message that crosses a process boundary is defined here, as a msgpack map carrying a schema
version (`v`). Services import this module (and the `SamplingParams` it carries) and nothing else to talk to each other, so a change of
contract is a change of this file. Decoding is strict: a message that is not a map, has an unknown
version or misses a required field raises `MalformedMessage`; workers log such a message and ack it
into the dead-letter stream instead of crashing on it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from baton.common.finish_reason import WIRE_REASONS, FinishReason
from baton.common.sampling_params import SamplingParams

# 2: one SamplingParams type; a handoff's partial_block_key is the store key
# 3: token events carry top/prompt logprobs, requests the client's request id
# 4: embeddings: a prefill request may ask for pooling, its one token event carries the vector
# 5: an embeddings request is one prefill request carrying all its inputs (`inputs`)
SCHEMA_VERSION = 5

# How an embedding request pools its prompt's hidden states (baton.engine.pooling.Pooling's values)
POOLING_NAMES = ("last", "mean", "cls")

# Streams and groups. Prefill and decode use consumer groups (one message, one worker);
# cancels are read by every worker without a group (a broadcast).
# The `{baton}` hash tag puts the four on one Redis Cluster slot: a prefill's handoff XADD and its
# XACK (and a dead letter and its XACK) are one single-slot MULTI/EXEC there too.
PIPELINE_TAG = "{baton}"
PREFILL_STREAM = PIPELINE_TAG + ":prefill"
PREFILL_GROUP = "prefill"
DECODE_STREAM = PIPELINE_TAG + ":decode"
DECODE_GROUP = "decode"
CANCEL_STREAM = PIPELINE_TAG + ":cancel"
DEAD_LETTER_STREAM = PIPELINE_TAG + ":dead"
# Approximate MAXLEN of the streams that may keep a bounded tail: a gateway's token stream (its
# gateway reads it as it comes) and the dead letters (parked for an operator; nothing consumes them).
# Never on the work streams (prefill, decode): a MAXLEN there deleted the oldest entries read or
# not, so a backlog past it lost requests. Their acknowledged entries are trimmed instead
# (baton.worker.runtime.trim_acknowledged), and admission at the gateway bounds what is unacked.
STREAM_MAXLEN = 10_000
# The cancel stream is a broadcast read with XREAD from each worker's last id, no group to say
# what was read: it is trimmed by age (gateway.backend), keeping this many seconds of cancels.
CANCEL_RETENTION_S = 300
# Field name of the single payload field of every stream entry.
PAYLOAD_FIELD = b"m"


def token_stream(gateway_id: str) -> str:
    """The stream of token events a gateway reads (one per gateway process).

    Only its gateway creates it (`create_token_stream`) and keeps its TTL fresh; workers add to it
    with NOMKSTREAM, so events for a gateway that is gone are dropped instead of re-creating its
    stream without a TTL (a leak that nothing would ever read). No hash tag: on a Redis Cluster
    each gateway's stream lands on its own slot, and nothing writes it atomically with other keys.
    """
    return f"baton:tokens:{gateway_id}"


async def create_token_stream(redis: Any, gateway_id: str, ttl_s: int) -> None:
    """Create a gateway's (empty) token stream if it does not exist, with its TTL."""
    from redis.exceptions import ResponseError

    try:
        # An empty stream can only be created through a consumer group; nothing reads this one.
        await redis.xgroup_create(token_stream(gateway_id), "keepalive", id="$", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    await redis.expire(token_stream(gateway_id), ttl_s)


def heartbeat_key(kind: str, worker_id: str) -> str:
    """Name of a worker's (or gateway's) heartbeat: a member of the heartbeat index, not a key of
    its own (baton/common/heartbeats.py)."""
    return f"baton:heartbeat:{kind}:{worker_id}"


class MalformedMessage(ValueError):
    """A stream entry that does not decode into a known message of this schema version."""


@dataclass
class PrefillRequest:
    """gateway -> prefill worker: run this prompt, publish the first token, hand off to decode."""

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # wall clock (time.time()) when the gateway admitted the request
    kind: str = "prefill_request"
    # The client's x-request-id (or the one the gateway made up): for log lines, never for routing.
    client_request_id: str = ""
    trace_context: str = ""  # W3C traceparent of the gateway's request span (baton/common/tracing.py), or ""
    # An embedding request: "" (generation) or one of POOLING_NAMES. The prefill worker runs the
    # prompt, publishes one token event with the pooled vector (no token, no handoff) and frees its KV.
    pooling: str = ""
    # An embeddings batch (with `pooling`; prompt_token_ids is then empty): every input's token ids.
    # One stream entry for the whole HTTP request; the worker feeds its inputs to the engine a short
    # step at a time and publishes each vector in a token event whose `index` is the input's place.
    inputs: list[list[int]] = field(default_factory=list)


def pack_embedding(vector: Any) -> bytes:
    """A vector on the wire: little-endian float32 bytes (what OpenAI's base64 encoding holds)."""
    import numpy as np

    return np.asarray(vector, dtype="<f4").tobytes()


def unpack_embedding(data: bytes) -> list[float]:
    import numpy as np

    return np.frombuffer(data, dtype="<f4").tolist()


@dataclass
class Handoff:
    """prefill worker -> decode worker: the prompt's KV is in the store; continue from here.

    `block_hashes` are the store ids of the prompt's full blocks, in order: the decode worker loads
    them by these ids (and seeds its own block ids with them). The prompt's last, partial block (if
    any) is stored under `partial_block_key`, the store key to read (and delete when done).
    `output_token_ids` holds the tokens already generated (the first token; more after a resume on
    another worker).
    """

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_hashes: list[str]
    partial_block_key: str | None
    sampling: SamplingParams
    arrival_time: float
    first_token_time: float
    kind: str = "handoff"
    client_request_id: str = ""  # the PrefillRequest's, carried on for the decode worker's logs
    trace_context: str = ""  # the PrefillRequest's: decode's spans join the request's trace


@dataclass
class TokenEvent:
    """worker -> gateway: new tokens of a request, and whether it finished.

    `index` is the position in the output of `token_ids[0]`, so a gateway can drop duplicates and
    detect gaps. `finish_reason` is None while running, else STOP (EOS or stop token), LENGTH,
    CANCELLED or ERROR (with `error`): `baton.common.finish_reason.WIRE_REASONS`.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None  # its string value on the wire
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    kind: str = "token_event"
    # Only for requests that ask (SamplingParams.logprobs / prompt_logprobs), else empty:
    # per token in token_ids, [[token id, logprob], ...] of the k most likely;
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # on the first event, per prompt token: None (the first) or [logprob, [[id, logprob], ...]].
    prompt_logprobs: list[Any] = field(default_factory=list)
    # An embedding request's last (only) event: the pooled vector, not normalized (pack_embedding);
    # of an embeddings batch (PrefillRequest.inputs), one event per input, `index` its place
    embedding: bytes = b""


@dataclass
class TokenBatch:
    """worker -> gateway: the token events of one step for one gateway, in one stream entry.

    A decode step over 64 requests is one XADD per gateway instead of 64. Events keep their own
    indices, so duplicate and gap handling is the same as for single events.
    """

    events: list[TokenEvent]
    kind: str = "token_batch"


@dataclass
class Cancel:
    """gateway -> all workers: stop working on this request and free what it holds."""

    request_id: str
    gateway_id: str
    reason: str = "client disconnected"
    kind: str = "cancel"


MESSAGE_TYPES: dict[str, type] = {
    "prefill_request": PrefillRequest,
    "handoff": Handoff,
    "token_event": TokenEvent,
    "token_batch": TokenBatch,
    "cancel": Cancel,
}

T = TypeVar("T")


def encode(message: Any) -> bytes:
    """Serialize a message dataclass to msgpack bytes (with the schema version)."""
    payload = dataclasses.asdict(message)
    payload["v"] = SCHEMA_VERSION
    return msgpack.packb(payload, use_bin_type=True)


def decode(data: bytes, expected: type[T] | None = None) -> T:
    """Parse msgpack bytes into a message dataclass; raise MalformedMessage on anything wrong."""
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise MalformedMessage(f"not msgpack: {exc}") from exc
    if not isinstance(payload, dict):
        raise MalformedMessage(f"expected a map, got {type(payload).__name__}")
    version = payload.pop("v", None)
    if version != SCHEMA_VERSION:
        raise MalformedMessage(f"unknown schema version {version!r}")
    cls = MESSAGE_TYPES.get(payload.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise MalformedMessage(f"unknown message kind {payload.get('kind')!r}")
    if expected is not None and cls is not expected:
        raise MalformedMessage(f"expected {expected.__name__}, got {cls.__name__}")
    if cls is TokenBatch:
        return _decode_batch(payload)  # type: ignore[return-value]
    try:
        if "sampling" in payload:
            if not isinstance(payload["sampling"], dict):
                raise TypeError("sampling must be a map")
            payload["sampling"] = SamplingParams(**payload["sampling"])
        message = cls(**payload)
    except (TypeError, ValueError) as exc:
        raise MalformedMessage(f"bad fields for {cls.__name__}: {exc}") from exc
    _check_types(message)
    return message  # type: ignore[return-value]


def encode_token_batch(events: list[TokenEvent]) -> bytes:
    """A TokenBatch without dataclasses.asdict's deep copies (this runs every decode step)."""
    names = [f.name for f in dataclasses.fields(TokenEvent)]
    payload = {"events": [{n: getattr(e, n) for n in names} for e in events], "kind": "token_batch",
               "v": SCHEMA_VERSION}
    return msgpack.packb(payload, use_bin_type=True)


def _decode_batch(payload: dict) -> TokenBatch:
    raw_events = payload.get("events")
    if not isinstance(raw_events, list) or set(payload) - {"events", "kind"}:
        raise MalformedMessage("a token batch has exactly a list of events")
    events = []
    for raw in raw_events:
        if not isinstance(raw, dict) or raw.get("kind", "token_event") != "token_event":
            raise MalformedMessage("a token batch holds token events only")
        try:
            event = TokenEvent(**raw)
        except TypeError as exc:
            raise MalformedMessage(f"bad fields for TokenEvent: {exc}") from exc
        _check_types(event)
        events.append(event)
    return TokenBatch(events)


_WIRE_VALUES = frozenset(reason.value for reason in WIRE_REASONS)


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    # dataclasses.fields() builds its answer anew per call: it was the gateway's hottest line
    # (every token event of every stream passes here).
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_types(message: Any) -> None:
    """Reject fields of the wrong type (msgpack gives us whatever the sender wrote)."""
    for name in _field_names(type(message)):
        value = getattr(message, name)
        if name in ("prompt_token_ids", "output_token_ids", "token_ids"):
            if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
                raise MalformedMessage(f"{name} must be a list of ints")
        elif name in ("request_id", "gateway_id", "client_request_id", "trace_context") and not isinstance(value, str):
            raise MalformedMessage(f"{name} must be a string")
        elif name in ("top_logprobs", "prompt_logprobs") and not isinstance(value, list):
            raise MalformedMessage(f"{name} must be a list")
        elif name == "block_hashes" and (not isinstance(value, list) or not all(isinstance(h, str) for h in value)):
            raise MalformedMessage("block_hashes must be a list of strings")
        elif name == "inputs" and (not isinstance(value, list) or not all(
                isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in value)):
            raise MalformedMessage("inputs must be a list of lists of ints")
        elif name == "pooling" and value not in ("", *POOLING_NAMES):
            raise MalformedMessage(f"pooling must be one of {POOLING_NAMES} or empty")
        elif name == "embedding" and (not isinstance(value, bytes) or len(value) % 4):
            raise MalformedMessage("embedding must be float32 bytes")
        elif name == "partial_block_key" and value is not None and not isinstance(value, str):
            raise MalformedMessage("partial_block_key must be a string or nil")
        elif name == "finish_reason" and value is not None:
            if not isinstance(value, str) or value not in _WIRE_VALUES:
                raise MalformedMessage(f"finish_reason must be one of {sorted(map(str, WIRE_REASONS))} or nil")
            message.finish_reason = FinishReason(value)
