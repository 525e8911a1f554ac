"""`baton serve`'s checks before any child starts or any weight loads.

Each failure is one message that names the fix (`PreflightError`), raised in the time a socket bind
or a config read takes: not a gateway that dies at start and is restarted six times after both
workers loaded the model. The memory estimate is a warning only: a KV pool's pages are touched as
it fills, the file size of the weights is only near what a worker holds of them, and what the
workers map from one file (shared_weight_bytes) is counted once, so the sum is an estimate, not a
certainty.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from baton.common.model_files import weight_files


class PreflightError(Exception):
    """A reason `baton serve` cannot start, worded for the user (what is wrong and how to fix it)."""


# --------------------------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------------------------

def check_bindable(host: str, port: int, flag: str = "--port") -> None:
    """Bind `host:port` as uvicorn (uvloop's create_server) will: every address `host` resolves to,
    SO_REUSEADDR set (so a port in TIME_WAIT passes, as it will for the server); then close it.
    `flag` is what the user passes to pick another port."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(f"cannot bind {host!r}: not an address or a name this machine resolves ({exc.strerror}): "
                             "pass --host 127.0.0.1, 0.0.0.0 or one of this machine's addresses") from None
    for family, kind, proto, _name, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this kernel lacks: the server skips it too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds it
            try:
                sock.bind(address)
            except OSError as exc:
                raise PreflightError(_bind_failure(host, port, flag, exc)) from None


def _bind_failure(host: str, port: int, flag: str, exc: OSError) -> str:
    where = f"port {port} on {host or 'all addresses'}"
    if exc.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        by = f"by {holder}" if holder else "(by another process)"
        return f"{where} is in use {by}: pass {flag} N or stop it"
    if exc.errno == errno.EACCES:
        return f"{where} needs privileges to bind (ports below 1024 do): pass {flag} N with N >= 1024"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine: pass --host 127.0.0.1, 0.0.0.0 or one of its addresses"
    return f"cannot bind {where} ({exc.strerror or exc}): pass {flag} N or --host"


def port_holder(port: int, proc: Path = Path("/proc")) -> str | None:
    """'pid 123 (python3)' of a process of ours listening on `port` (Linux; another user's sockets
    cannot be matched to a process without privileges: None then, as anywhere it cannot tell)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "0100007F:1F40", state 0A = LISTEN, inode is the tenth field
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                name = (entry / "comm").read_text().strip()
                return f"pid {entry.name} ({name})"
        except OSError:  # another user's process, or one that just exited
            continue
    return None


def worker_metrics_ports(first: int | None, num_workers: int) -> list[int]:
    """The fixed ports `--worker-metrics-port` gives the workers (none without it)."""
    return [] if first is None else [first + i for i in range(num_workers)]


def check_ports(host: str, port: int, metrics_ports: list[int], metrics_host: str) -> None:
    """The gateway's port, then each worker's metrics port, free now and not each other's."""
    if port in metrics_ports:
        raise PreflightError(f"--port {port} is also a worker's metrics port (--worker-metrics-port gives the "
                             f"workers {metrics_ports[0]}..{metrics_ports[-1]}): pass another --port or "
                             "--worker-metrics-port")
    check_bindable(host, port)
    for metrics_port in metrics_ports:
        check_bindable(metrics_host, metrics_port, flag="--worker-metrics-port")


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

def read_model_config(model_dir: Path):  # -> ModelConfig (imported here: baton.model.runtime loads torch)
    """The model's config as the workers will read it; a config they would refuse (a model_type
    Baton does not run, a key it needs missing) is a PreflightError saying so."""
    from baton.model.runtime import ModelConfig

    try:
        return ModelConfig.from_dir(model_dir)
    except KeyError as exc:
        why = f"its config.json has no {exc.args[0]!r}, which the workers need"
    except json.JSONDecodeError as exc:
        why = f"its config.json is not JSON ({exc})"
    except (ValueError, TypeError, OSError) as exc:
        why = str(exc)  # an unsupported model_type: family_spec's message names the supported ones
    raise PreflightError(f"cannot serve {model_dir}: {why}; pass --model with a checkpoint Baton runs")


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (what can be allocated without swapping); None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class MemoryEstimate:
    """What the workers together may hold: the weights (the part every worker maps from one file
    counted once, the rest once per worker), and each worker's KV pool."""

    weights_bytes: int  # one worker's weights
    kv_pool_bytes: list[int]  # each worker's pool
    available_bytes: int | None  # MemAvailable
    # of weights_bytes, what the workers map from one file per machine (a GGUF's packed blocks,
    # bf16 packs: baton.model.packed_cache, shared_weights): page cache, counted once
    shared_bytes: int = 0

    @property
    def num_workers(self) -> int:
        return len(self.kv_pool_bytes)

    @property
    def private_weights_bytes(self) -> int:
        return self.weights_bytes - self.shared_bytes

    @property
    def total_bytes(self) -> int:
        return self.shared_bytes + self.private_weights_bytes * self.num_workers + sum(self.kv_pool_bytes)

    def warning(self) -> str | None:
        """A warning when the estimate exceeds the memory available, else None."""
        if self.available_bytes is None or self.total_bytes <= self.available_bytes:
            return None
        kv = sum(self.kv_pool_bytes)
        weights = self.total_bytes - kv
        # the fix that helps most: the larger of the two parts
        smaller = ("a smaller --kv-cache-memory or --prefill-kv-cache-memory (or --num-kv-blocks, or --kv-cache-dtype int8)"
                   if kv >= weights else "--quantization int8 or int4")
        n = self.num_workers
        if self.shared_bytes:
            parts = f"{format_bytes(self.shared_bytes)} of weights mapped once"
            if self.private_weights_bytes:
                parts += f" + {n} x {format_bytes(self.private_weights_bytes)} per worker"
        else:
            parts = f"{n} x {format_bytes(self.weights_bytes)} of weights"
        return (f"{n} workers may need about {format_bytes(self.total_bytes)} ({parts} + {format_bytes(kv)} of "
                f"KV pools) but {format_bytes(self.available_bytes)} is available: expect swapping or the OOM "
                f"killer; pass {smaller}, or fewer --prefill-workers/--decode-workers")


def shared_weight_bytes(weights_bytes: int) -> int:
    """Of one worker's weights, what every worker maps from one file per machine
    (baton.model.packed_cache, baton.model.shared_weights): a GGUF's blocks served as the file ships
    them, the native bf16 packs, the dense weights F.linear reads (float32 where the CPU has no bf16
    instructions, a GGUF dequantized), the embedding tables, a MoE's experts and the native packs
    int8 / int4 make at load: all of them (a CPU without the native quantized kernels keeps int8 /
    int4 weights private: an estimate), and nothing with `BATON_PACKED_CACHE=off`."""
    if os.environ.get("BATON_PACKED_CACHE", "on").strip().lower() in ("0", "off", "false", "no"):
        return 0
    return weights_bytes


def kv_pool_bytes(config, block_size: int | None, dtype: str, kv_cache_dtype: str,  # config: a ModelConfig
                  num_kv_blocks: int | None, kv_cache_memory: str | None, flag: str = "--kv-cache-memory") -> int:
    """One worker's KV pool as its flags size it: --num-kv-blocks blocks of the model's block bytes,
    else --kv-cache-memory (the worker's own default when neither is given). `flag`: the `baton serve`
    flag `kv_cache_memory` came from, for the message when it is not a size."""
    from baton.worker.args import parse_bytes

    defaults = _worker_defaults()
    if num_kv_blocks is not None:
        from baton.model.runtime import kv_block_bytes

        return num_kv_blocks * kv_block_bytes(config, block_size or defaults["block_size"], dtype, kv_cache_dtype)
    if kv_cache_memory is None:
        return int(defaults["kv_cache_memory"])
    try:
        return parse_bytes(kv_cache_memory)
    except argparse.ArgumentTypeError as exc:
        raise PreflightError(f"{flag}: {exc}") from None


# A prefill worker's pool holds the prompts it computes at once and its local prefix cache: room for
# this many full-context prompts, and never less than the floor (small models' pools cost little).
PREFILL_KV_FULL_PROMPTS = 2
PREFILL_KV_FLOOR_BYTES = 256 << 20


def context_tokens(model_dir: Path, config, args: argparse.Namespace) -> int:
    """The longest request the gateway will admit: --max-model-len (or TGI's --max-total-tokens) where
    given, else the model's own context (as the gateway derives it), else its config's positions."""
    from baton.common.context_length import model_context_length

    given = [n for n in (args.max_model_len, args.max_total_tokens) if n]
    if given:
        return min(given)
    return model_context_length(model_dir) or config.max_position_embeddings


def default_prefill_kv_bytes(config, context: int, block_size: int | None, dtype: str,
                             kv_cache_dtype: str) -> int:
    """`baton serve`'s default prefill KV pool: PREFILL_KV_FULL_PROMPTS prompts of `context` tokens
    (whole blocks of the model's block bytes, known without loading it), at least the floor. Not the
    workers' 1 GiB default, which is most of a prefill worker's private memory on a small model and
    too little for one full prompt on a long-context one."""
    from baton.model.runtime import kv_block_bytes, kv_groups

    block_size = block_size or int(_worker_defaults()["block_size"])  # type: ignore[arg-type]
    # a prefill worker keeps a prompt's every block (they are handed off): one per table per position
    blocks = -(-context // block_size) * kv_groups(config).num_tables
    prompt_bytes = blocks * kv_block_bytes(config, block_size, dtype, kv_cache_dtype)
    return max(PREFILL_KV_FLOOR_BYTES, PREFILL_KV_FULL_PROMPTS * prompt_bytes)


def size_flag_value(n: int) -> str:
    """Bytes as a --kv-cache-memory value a person reads in `ps`: whole MiB, rounded up."""
    return f"{-(-n // (1 << 20))}MiB"


def _worker_defaults() -> dict[str, object]:
    """The workers' own defaults (block size, KV pool size), from their parser: one source of truth."""
    from baton.worker.args import add_common_args

    parser = argparse.ArgumentParser()
    add_common_args(parser, "decode")
    return {"block_size": parser.get_default("block_size"), "kv_cache_memory": parser.get_default("kv_cache_memory")}


@dataclass(frozen=True)
class ModelCheck:
    """What the preflight learned of the model: for the start-up lines and the memory warning."""

    config: object  # the ModelConfig the workers will read
    weights: list[Path]
    memory: MemoryEstimate
    prefill_kv_cache_memory: str  # what each prefill worker gets as --kv-cache-memory

    def weights_label(self) -> str:
        """'model.safetensors 538.1 MiB' (or the GGUF served, or 'N files 12.0 GiB')."""
        name = self.weights[0].name if len(self.weights) == 1 else f"{len(self.weights)} files"
        return f"{name} {format_bytes(self.memory.weights_bytes)}"


# bytes a weight takes once loaded, by --dtype ("auto" counted as float32, the widest it may resolve
# to, as the KV estimate counts it) and by --quantization where that quantizes at load
SERVED_BYTES = {"float32": 4.0, "auto": 4.0, "bfloat16": 2.0, "float16": 2.0}
QUANTIZED_BYTES = {"int8": 1.25, "int4": 0.75}  # the native packs: int8 / 4-bit plus fp32 scales per 32


def fp8_elements(path: Path) -> int:
    """How many weights of a safetensors file are stored as FP8 (e4m3 / e5m2), from its header alone
    (a u64 length, then that much JSON). A file without such a header (no safetensors: the workers'
    load says what is wrong with it) counts none: this is an estimate, not the load's check."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= path.stat().st_size - 8:
            return 0
        raw = f.read(length)
    if not raw.startswith(b"{"):
        return 0
    header = json.loads(raw)
    return sum(math.prod(entry["shape"]) for name, entry in header.items()
               if name != "__metadata__" and str(entry.get("dtype", "")).startswith("F8_"))


def served_weight_bytes(files: list[Path], dtype: str, quantization: str) -> int:
    """One copy of the weights as a worker holds them: the files' sizes, except that an FP8
    checkpoint's weights (one byte each on disk) are dequantized at load into --dtype (or
    requantized by int8/int4), so they count at that width (baton.model.fp8_blocks)."""
    width = QUANTIZED_BYTES.get(quantization, SERVED_BYTES.get(dtype, 4.0))
    total = 0
    for path in files:
        total += path.stat().st_size
        if path.suffix == ".safetensors":
            total += int(fp8_elements(path) * (width - 1))
    return total


def check_mtp_head(model_dir: Path, config, speculative) -> None:  # config: a ModelConfig
    """`--speculative-config '{"method": "mtp"}'`: the checkpoint carries the MTP layer the decode
    workers will draft with (its safetensors headers name it), or a PreflightError says so."""
    if speculative is None or getattr(speculative, "method", None) != "mtp":
        return
    from safetensors import safe_open

    from baton.common.model_files import gguf_source
    from baton.model.runtime import mtp_config, mtp_prefix

    fix = "serve it without --speculative-config, or with {\"method\": \"ngram\", ...}"
    if gguf_source(model_dir) is not None:
        raise PreflightError(f"cannot draft with the MTP layer of {model_dir.name}: from a GGUF it is not served "
                             f"yet (the safetensors checkpoint is); {fix}")
    try:
        mtp_config(config)
    except ValueError as exc:
        raise PreflightError(f"cannot draft with the MTP layer of {model_dir.name}: {exc}; {fix}") from None
    prefix, names = mtp_prefix(config), []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += [n.removeprefix("model.").removeprefix("language_model.") for n in f.keys()]
    if not any(name.startswith(prefix) for name in names):
        raise PreflightError(f"cannot draft with the MTP layer of {model_dir.name}: the checkpoint carries none "
                             f"(no {prefix}* tensors); {fix}")


def check_model(model_dir: Path, args: argparse.Namespace) -> ModelCheck:
    """The model's config (refused here if the workers would refuse it) and the memory estimate."""
    config = read_model_config(model_dir)
    check_mtp_head(model_dir, config, getattr(args, "speculative_config", None))
    weights = weight_files(model_dir, args.dtype, args.quantization)
    weights_bytes = served_weight_bytes(weights, args.dtype, args.quantization)
    kv_dtype = args.kv_cache_dtype
    # prefill workers get --prefill-kv-cache-memory as their --kv-cache-memory, by default room for
    # a few full-context prompts (DECODE_FLAGS' pool flags reach the decode workers only)
    prefill_flag = args.prefill_kv_cache_memory
    if prefill_flag is None:
        default = default_prefill_kv_bytes(config, context_tokens(model_dir, config, args), args.block_size,
                                           args.dtype, kv_dtype)
        prefill_flag = size_flag_value(default)
    prefill_pool = kv_pool_bytes(config, args.block_size, args.dtype, kv_dtype, None, prefill_flag,
                                 "--prefill-kv-cache-memory")
    decode_pool = kv_pool_bytes(config, args.block_size, args.dtype, kv_dtype, args.num_kv_blocks,
                                args.kv_cache_memory)
    pools = [prefill_pool] * args.prefill_workers + [decode_pool] * args.decode_workers
    shared = shared_weight_bytes(weights_bytes)
    return ModelCheck(config, weights, MemoryEstimate(weights_bytes, pools, mem_available(), shared), prefill_flag)
