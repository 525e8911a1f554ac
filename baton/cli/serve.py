"""`baton serve`: run a whole Baton deployment on one machine, as supervised child processes.

Before any child starts, a preflight (`baton.cli.preflight`) refuses what would only fail later, after
every worker loaded the weights: a gateway or metrics port that cannot be bound, a model that cannot
be resolved, a config.json the workers would refuse; and it warns when the workers' weights and KV
pools may not fit the memory available. One model directory is resolved once (fetching the default
model if needed) and handed to every child. Unless a Redis URL is given, a private redis-server is
started on a free port. Then the prefill workers, the decode workers and the gateway start as
`python -m <service>` children, with a progress line for each step and a short summary once serving
(`baton.cli.startup_report`). Each child gets its whole config at once: its config object (a
`WorkerConfig`, the gateway's `Settings`), built here from this command's flags over the child's
own defaults, as JSON in $BATON_SERVICE_CONFIG (baton.common.service_config).

Threads are a budget (DESIGN.md): two processes each running 2 torch threads on 2 cores slow down
catastrophically, so the workers' `--threads` add up to at most the cores this process may use.

The supervisor (`baton.cli.supervisor`) owns its children: they run in their own process group (a terminal's Ctrl-C reaches
only the supervisor, which then stops them in order: gateway first, then the workers, then Redis),
and on Linux each child gets SIGTERM from the kernel if the supervisor itself dies (even by
SIGKILL). A child that exits on its own is restarted with backoff; so is the private Redis, on the
same port with the same password (it comes back empty: the workers recreate their consumer groups).

Secrets never go on a child's command line, which every local user can read in `ps`, nor in its
config JSON: the Redis URL (with the private Redis's random password) and the API key travel in
their own variables (REDIS_URL, BATON_API_KEY), which the services read by default.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from baton.common.service_config import SERVICE_CONFIG_ENV
from baton.common.urls import redact_url
from baton.worker import thread_lending as core_share
from baton.cli.child_configs import (DECODE_FLAGS, FLAG_ALIASES, GATEWAY_FLAGS, PREFILL_FLAGS, WORKER_FLAGS,
                                     decode_worker_config, gateway_settings, prefill_worker_config)
from baton.cli.preflight import PreflightError, check_model, check_ports, worker_metrics_ports
from baton.cli.startup_report import fetch_json, model_origin, summary_lines
from baton.cli.supervisor import API_KEY_ENV, ChildExited, ChildSpec, StopRequested, Supervisor
from baton.worker.args import (DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPE_HELP, QUANTIZATION_CHOICES,
                               QUANTIZATION_HELP)

PREFILL_MODULE = "prefill_worker"
DECODE_MODULE = "decode_worker"
GATEWAY_MODULE = "gateway"
PROGRESS_EVERY = 10.0  # seconds between "waiting for ..." lines while the workers load

# Environment variables that carry secrets to the children (never argv: `ps` shows argv to all).
REDIS_URL_ENV = "REDIS_URL"


# --------------------------------------------------------------------------------------------
# Thread budget
# --------------------------------------------------------------------------------------------

def available_cpus() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota if any."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:  # containers started with --cpus N
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@dataclass
class ThreadPlan:
    prefill: list[int]
    decode: list[int]
    cpus: int
    warning: str | None = None

    @property
    def total(self) -> int:
        return sum(self.prefill) + sum(self.decode)


def plan_threads(cpus: int, prefill_workers: int, decode_workers: int,
                 threads_per_worker: int | None = None) -> ThreadPlan:
    """Give each worker torch threads so that all of them together use at most `cpus` cores.

    Every worker gets at least one thread. Cores that do not divide evenly go to the prefill
    workers first (prefill is compute-bound; decode is mostly memory-bound). With more workers
    than cores, each gets one thread and the plan carries a warning. An explicit
    `threads_per_worker` is obeyed, with a warning when it oversubscribes.
    """
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError("need at least one prefill worker and one decode worker")
    cpus = max(1, cpus)
    n = prefill_workers + decode_workers
    if threads_per_worker is not None:
        if threads_per_worker < 1:
            raise ValueError("--threads-per-worker must be at least 1")
        plan = ThreadPlan([threads_per_worker] * prefill_workers,
                          [threads_per_worker] * decode_workers, cpus)
    else:
        base, extra = divmod(cpus, n)
        base = max(1, base)
        counts = [base + (1 if i < extra else 0) for i in range(n)] if cpus >= n else [1] * n
        plan = ThreadPlan(counts[:prefill_workers], counts[prefill_workers:], cpus)
    if plan.total > cpus:
        plan.warning = (
            f"{n} workers with {plan.total} torch threads in all on {cpus} cores: oversubscribed, "
            "expect every step to slow down badly (see DESIGN.md, 'Threads are a budget')"
        )
    return plan


# --------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `baton serve` (kept here so the CLI module stays small)."""
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory, .gguf file, or Hub repo id such as "
                             "HuggingFaceTB/SmolLM2-135M-Instruct (downloaded into the Hugging Face cache; "
                             "HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE apply) (default: the default model, "
                             "fetched if needed)")
    parser.add_argument("--gguf-file", default=None, metavar="NAME.gguf",
                        help="with --model owner/repo: serve this one GGUF file of the Hub repo (downloaded "
                             "alone); the same as --model owner/repo:QUANT, which picks the file by its "
                             "quantization tag")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or None,
                        help="use this Redis: redis[s]://, a Redis Cluster as redis[s]+cluster://host:port[,host:port], "
                             "a Sentinel's master as redis[s]+sentinel://host:port/<service> (default: $REDIS_URL, "
                             "else a private redis-server on a free port)")
    parser.add_argument("--prefill-workers", type=int, default=1, help="prefill worker processes (default 1)")
    parser.add_argument("--decode-workers", type=int, default=1, help="decode worker processes (default 1)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="worker compute dtype (default auto: bfloat16 on CUDA and on CPUs with fast "
                             "bf16, else float32)")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES, help="worker " + QUANTIZATION_HELP)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="workers' " + KV_CACHE_DTYPE_HELP)
    parser.add_argument("--threads-per-worker", type=int, default=None,
                        help="torch threads per worker (default: split this machine's cores among the workers)")
    parser.add_argument("--no-core-share", action="store_true",
                        help="keep each worker on its own threads (default: an idle prefill worker lends its "
                             "threads to a decode worker whose steps are short: one or two clients get the machine's cores)")
    parser.add_argument("--worker-metrics-port", type=int, default=None,
                        help="first Prometheus port for the workers: prefill i gets PORT+i, decode j PORT+#prefill+j (default: none)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for the deployment to become ready (default 600)")
    parser.add_argument("--stop-timeout", type=float, default=80.0,
                        help="seconds children get to stop after SIGTERM before SIGKILL (default 80: the "
                             "gateway stops first and gets half, its 40 s shutdown grace; then the workers "
                             "the rest, more than their 30 s drain; a second Ctrl-C kills at once)")
    parser.add_argument("--log-format", default=os.environ.get("BATON_LOG_FORMAT") or None, choices=["text", "json"],
                        help="every child's log lines: text or one JSON object per line (default: "
                             "$BATON_LOG_FORMAT, else text)")
    group = parser.add_argument_group("gateway limits (the gateway's when given)")
    for flag, typ, help_ in GATEWAY_FLAGS:
        group.add_argument(flag, type=typ, default=None, help=help_, **_choices(flag))
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names requests may give as `model` (default: the model directory's name); "
                            "the first is the one reported")
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    group.add_argument("--strict-api", action="store_true",
                       help="answer unknown request fields with a 4xx (default: ignore them, log them once "
                            "and list them in the x-baton-ignored-fields header)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM compatibility; no effect: tool_choice auto is always on")
    group.add_argument("--normalize", action="store_true", help="L2-normalize embeddings (default: as the checkpoint says, else yes)")
    group.add_argument("--no-normalize", action="store_true", help="return embeddings unnormalized")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help="require 'Authorization: Bearer KEY' on the API (default: $BATON_API_KEY; "
                            "prefer the variable: a flag is visible to every local user in `ps`)")
    group = parser.add_argument_group("worker settings (the workers' when given)")
    for flag, typ, help_ in WORKER_FLAGS + PREFILL_FLAGS + DECODE_FLAGS:
        kwargs = {"choices": ["no-evict", "max-utilization"]} if flag == "--scheduler-policy" else {}
        group.add_argument(flag, *FLAG_ALIASES.get(flag, ()), type=typ, default=None, help=help_, **kwargs)
    group.add_argument("--prefill-kv-cache-memory", default=None, metavar="SIZE",
                       help="prefill worker: KV pool size, e.g. 512MiB (its prompts in flight and its prefix cache; "
                            "default: 2 full-context prompts of KV, at least 256MiB)")


def _choices(flag: str) -> dict[str, list[str]]:
    """The gateway's own choices, checked here too: a typo must fail before the workers load the model."""
    from gateway.parsers import reasoning, tool_calls
    from gateway.sampling_defaults import GENERATION_CONFIG_MODES

    known = {"--reasoning-parser": reasoning.NAMES, "--tool-call-parser": tool_calls.NAMES,
             "--pooling": ("last", "mean", "cls"), "--generation-config": GENERATION_CONFIG_MODES}
    return {"choices": list(known[flag])} if flag in known else {}


def build_child_specs(args: argparse.Namespace, model_dir: Path, redis_url: str,
                      plan: ThreadPlan, python: str = sys.executable,
                      core_share_fd: int | None = None) -> list[ChildSpec]:
    """Every child, in start order: prefill workers, decode workers, gateway. Each is `python -m
    <service>` with its whole config as JSON in $BATON_SERVICE_CONFIG; the Redis URL and the API key
    go in its environment apart (never in the JSON, never on its command line).
    `core_share_fd`: the descriptor of the ledger through which idle prefill workers lend their threads
    (inherited by the workers; None: none)."""
    specs: list[ChildSpec] = []
    secret_env = {REDIS_URL_ENV: redis_url}
    first_port = args.worker_metrics_port
    for i, threads in enumerate(plan.prefill):
        config = prefill_worker_config(args, model_dir, redis_url, threads,
                                       None if first_port is None else first_port + i, core_share_fd, i)
        specs.append(ChildSpec(f"prefill_worker[{i}]", [python, "-m", PREFILL_MODULE],
                               {**_thread_env(threads), **secret_env, SERVICE_CONFIG_ENV: config.to_json()},
                               "prefill", _fds(core_share_fd)))
    for j, threads in enumerate(plan.decode):
        port = None if first_port is None else first_port + len(plan.prefill) + j
        config = decode_worker_config(args, model_dir, redis_url, threads, port, core_share_fd, j)
        specs.append(ChildSpec(f"decode_worker[{j}]", [python, "-m", DECODE_MODULE],
                               {**_thread_env(threads), **secret_env, SERVICE_CONFIG_ENV: config.to_json()},
                               "decode", _fds(core_share_fd)))
    gateway_env = {**_thread_env(1), **secret_env,
                   SERVICE_CONFIG_ENV: gateway_settings(args, model_dir, redis_url).to_json()}
    if args.api_key:
        gateway_env[API_KEY_ENV] = args.api_key
    specs.append(ChildSpec("gateway", [python, "-m", GATEWAY_MODULE], gateway_env, "gateway"))
    return specs


def _fds(fd: int | None) -> tuple[int, ...]:
    return () if fd is None else (fd,)


def _thread_env(threads: int) -> dict[str, str]:
    # Workers call torch.set_num_threads(--threads) themselves; these keep the OpenMP / MKL pools
    # (and the tokenizers' Rust pool) from starting one thread per core before that happens.
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


# --------------------------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------------------------

def probe_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def gateway_readiness(host: str, port: int, timeout: float = 2.0) -> list[str]:
    """What the deployment still lacks, as the gateway's GET /ready says ([] when it is ready):
    Redis, a live prefill worker, a live decode worker; or the gateway itself while it does not
    answer."""
    url = f"http://{probe_host(host)}:{port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return [] if resp.status == 200 else ["the gateway's /ready"]
    except urllib.error.HTTPError as exc:  # 503: the body names what is missing
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        finally:
            exc.close()
        if body.get("redis") == "unreachable":
            return ["redis"]
        return [str(m) for m in body.get("missing", [])] or [f"the gateway's /ready ({exc.code})"]
    except (urllib.error.URLError, OSError, ValueError):
        return ["the gateway"]


def wait_until_ready(sup: Supervisor, host: str, port: int, timeout: float,
                     progress_every: float = PROGRESS_EVERY) -> None:
    """Until the gateway's /ready says ready; a line when what it waits for changes, and every
    `progress_every` seconds besides (loading a large model takes minutes: silence reads as a hang)."""
    started = time.monotonic()
    deadline = started + timeout
    waiting_for = ""
    said_at = started
    while True:
        sup.check()
        missing = gateway_readiness(host, port)
        if not missing:
            return
        now = time.monotonic()
        if " and ".join(missing) != waiting_for:
            waiting_for = " and ".join(missing)
            sup.log(f"waiting for {waiting_for} ...")
            said_at = now
        elif now - said_at >= progress_every:
            sup.log(f"waiting for {waiting_for} ... ({now - started:.0f}s)")
            said_at = now
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:g}s: still waiting for {waiting_for}")
        sup.sleep(0.5)


def serving_summary(args: argparse.Namespace, model_name: str, model_dir: Path) -> list[str]:
    """'Baton is serving X at URL' and a few lines on what and how (baton.cli.startup_report)."""
    from baton.common.model_files import hub_gguf_spec, is_hub_model_name

    url = f"http://{args.host}:{args.port}"
    probe = f"http://{probe_host(args.host)}:{args.port}"
    settings = (f"dtype {args.dtype}, quantization {args.quantization}, "
                f"KV cache dtype {args.kv_cache_dtype}")
    gguf_file = args.gguf_file
    from_hub = is_hub_model_name(args.model) or gguf_file is not None or hub_gguf_spec(args.model) is not None
    hub_name = f"{args.model} --gguf-file {gguf_file}" if gguf_file else args.model
    origin = model_origin(hub_name, model_dir, from_hub)
    return summary_lines(model_name=model_name, origin=origin, url=url, settings=settings, api_key=args.api_key,
                         stats=fetch_json(f"{probe}/stats", args.api_key),
                         info=fetch_json(f"{probe}/info", args.api_key), decode_workers=args.decode_workers)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from baton.common.model_files import model_display_name, resolve_model
    from gateway.chat_template import load_chat_template
    from gateway.sampling_defaults import load as load_sampling_defaults

    log = lambda msg: print(f"baton: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    positional = args.model_positional
    if positional is not None:
        if args.model is not None and args.model != positional:
            log(f"two models given: {positional} and --model {args.model}; give one")
            return 2
        args.model = positional
    if args.prefill_workers < 1 or args.decode_workers < 1:
        log("need at least one prefill worker and one decode worker")
        return 2
    if args.num_kv_blocks is not None and args.kv_cache_memory is not None:
        log("give --num-kv-blocks or --kv-cache-memory, not both")
        return 2
    plan = plan_threads(available_cpus(), args.prefill_workers, args.decode_workers,
                        args.threads_per_worker)
    if plan.warning:
        log(f"warning: {plan.warning}")

    try:  # before the model is fetched: a taken port is a message in a second, not six restarts
        metrics_ports = worker_metrics_ports(args.worker_metrics_port, len(plan.prefill) + len(plan.decode))
        check_ports(args.host, args.port, metrics_ports, os.environ.get("BATON_METRICS_HOST") or "127.0.0.1")
    except PreflightError as exc:
        log(str(exc))
        return 2
    try:
        model_dir = Path(resolve_model(args.model, args.gguf_file)).resolve()
    except (OSError, subprocess.CalledProcessError, StopIteration, ValueError) as exc:
        log(f"cannot load the model: {exc or type(exc).__name__}")
        return 2
    if args.chat_template is not None:
        try:  # now, not as a gateway that dies at start and is restarted over and over
            load_chat_template(args.chat_template)
        except (ValueError, OSError) as exc:
            log(str(exc))
            return 2
    try:  # a generation_config.json no request could follow: now too, not as a gateway that keeps dying
        load_sampling_defaults(model_dir, args.generation_config or "auto")
    except ValueError as exc:
        log(str(exc))
        return 2
    try:  # a config the workers would refuse, refused before they load anything
        model_check = check_model(model_dir, args)
    except PreflightError as exc:
        log(str(exc))
        return 2
    args.prefill_kv_cache_memory = model_check.prefill_kv_cache_memory  # the default, sized to the context
    if warning := model_check.memory.warning():
        log(f"warning: {warning}")
    if not args.served_model_name:  # a Hub model is served as its repo id, not its snapshot's hash
        args.served_model_name = [model_display_name(args.model, model_dir, args.gguf_file)]
    model_name = args.served_model_name[0]
    try:  # settings the gateway would refuse (a context past the model's ...): refused now, as above
        gateway_settings(args, model_dir, args.redis_url or "").validate()
    except ValueError as exc:
        log(str(exc))
        return 2
    log(f"model {model_name} from {model_dir}")
    log(f"threads: prefill {plan.prefill}, decode {plan.decode} on {plan.cpus} cores")

    sup = Supervisor(stop_timeout=args.stop_timeout, log=log)
    sup.install_signal_handlers()
    private_redis = None
    ledger_fd: int | None = None  # the core-share ledger (a memfd the workers inherit)
    exit_code = 0
    try:
        redis_url = args.redis_url
        if redis_url:
            log(f"redis: {redact_url(redis_url)}")
        else:
            from baton.cli.redis_server import free_port, start_private_redis

            redis_port = free_port()
            log(f"starting redis-server on port {redis_port}")
            # A random password: any local user can reach a port on 127.0.0.1.
            private_redis = start_private_redis(port=redis_port, password=secrets.token_urlsafe(32))
            redis_url = private_redis.url
            sup.watch("redis-server", private_redis)
            log(f"redis: {private_redis.display_url} (private, pid {private_redis.process.pid})")
        # (not where the plan oversubscribes already: --threads-per-worker beyond the cores)
        if not args.no_core_share and len(plan.prefill) <= 64 and plan.total <= plan.cpus:
            ledger_fd = core_share.create_anonymous(len(plan.prefill), len(plan.decode))
        log(f"loading {model_name} in {len(plan.prefill)} prefill + {len(plan.decode)} decode worker(s) "
            f"(weights: {model_check.weights_label()})")
        for spec in build_child_specs(args, Path(model_dir), redis_url, plan, core_share_fd=ledger_fd):
            if spec.role == "gateway":
                log(f"starting the gateway on {args.host}:{args.port}")
            sup.start(spec)
        wait_until_ready(sup, args.host, args.port, args.startup_timeout)
        print("\n".join(serving_summary(args, model_name, model_dir)), flush=True)
        while True:
            sup.sleep(3600)
    except StopRequested:
        log(f"{signal.Signals(sup.stop_signal).name}: stopping")  # type: ignore[arg-type]
    except ChildExited as exc:
        log(f"{exc}; stopping everything")
        exit_code = 1
    except TimeoutError as exc:
        log(f"{exc}; stopping everything")
        exit_code = 1
    except Exception as exc:  # anything else: still never leave children behind
        log(f"error: {type(exc).__name__}: {exc}; stopping everything")
        exit_code = 1
    finally:
        sup.stop_all()
        if private_redis is not None:
            private_redis.stop()
        if ledger_fd is not None:
            os.close(ledger_fd)
        log("stopped")
    return exit_code
