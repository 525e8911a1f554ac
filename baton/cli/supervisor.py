"""The supervisor of `baton serve`: starts children, restarts the ones that die (with backoff,
giving up after repeated deaths), restarts a watched private Redis, and stops everything in order.

It owns its children: they run in their own process group (a terminal's Ctrl-C reaches only the
supervisor, which then stops them in order: gateway first, then the workers, then Redis), and on
Linux each child gets SIGTERM from the kernel if the supervisor itself dies (even by SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from baton.cli.redis_server import child_preexec

PER_PROCESS_ENV = ("BATON_WORKER_ID", "BATON_GATEWAY_ID", "BATON_METRICS_PORT")
USAGE_ERROR = 2  # the exit status of a child whose arguments argparse refused

# The environment variable holding the gateway's API key: removed from every other child's env.
API_KEY_ENV = "BATON_API_KEY"


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    role: str = ""  # "gateway" | "prefill" | "decode"
    pass_fds: tuple[int, ...] = ()  # descriptors the child inherits (the core-share ledger's)


class Restartable(Protocol):
    """A process the supervisor watches but does not own the command line of (the private Redis)."""
    process: subprocess.Popen

    def restart(self) -> None: ...


class ChildExited(RuntimeError):
    def __init__(self, name: str, pid: int, returncode: int, why: str = "") -> None:
        how = (f"was killed by signal {-returncode}" if returncode < 0
               else f"exited with code {returncode}")
        super().__init__(f"{name} (pid {pid}) {how}" + (f": {why}" if why else ""))
        self.name = name
        self.returncode = returncode


class StopRequested(Exception):
    pass


class Supervisor:
    """Starts children, restarts the ones that die, and stops all of them in order.

    A child that dies is restarted after a backoff (0.5 s, doubling, at most 10 s); the survivors
    keep serving meanwhile (a dead worker's unacked requests are claimed by its peers or by its
    replacement). A child that dies more than `max_restarts` times within `restart_window` seconds
    is given up on, and that is fatal only when it leaves its pool empty (or it is the gateway).
    A watched process (the private redis-server) is restarted under the same policy; giving up on
    it is fatal, since nothing works without it.
    """

    def __init__(self, stop_timeout: float = 10.0, log: Callable[[str], None] | None = None,
                 max_restarts: int = 5, restart_window: float = 60.0) -> None:
        self.children: list[tuple[ChildSpec, subprocess.Popen]] = []
        self.watched: list[tuple[str, Restartable]] = []  # stopped by their owners, not by us
        self.stop_timeout = stop_timeout
        self.stop_signal: int | None = None
        self.log = log or (lambda msg: print(f"baton: {msg}", file=sys.stderr, flush=True))
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.deaths: dict[str, list[float]] = {}
        self.pending_restarts: list[tuple[float, ChildSpec]] = []  # (when, what)
        self.pending_watched: list[tuple[float, str, Restartable]] = []
        self.num_restarts = 0

    # signals ---------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            # A second Ctrl-C while stopping: do not make the user wait for the grace period.
            for _spec, proc in self.children:
                if proc.poll() is None:
                    _kill(proc, signal.SIGKILL)

    # children --------------------------------------------------------------------------------
    def start(self, spec: ChildSpec) -> subprocess.Popen:
        # Only the children whose spec names a secret get it (the workers never need the API key).
        # Nor one process's identity or port: set for `baton serve`, BATON_WORKER_ID (say) would give
        # every worker the same one (baton.common.env_flags).
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV and k not in PER_PROCESS_ENV}
        env.update(spec.env)
        # Own process group: the terminal's Ctrl-C reaches only us, and we stop children in order.
        proc = subprocess.Popen(
            spec.argv, env=env, stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # keep our stdout for our own status lines
            preexec_fn=child_preexec(new_session=False, death_signal=signal.SIGTERM), pass_fds=spec.pass_fds,
        )
        self.children.append((spec, proc))
        self.log(f"started {spec.name} (pid {proc.pid})")
        return proc

    def watch(self, name: str, server: Restartable) -> None:
        """Also restart this process (say, the private redis-server) when it dies."""
        self.watched.append((name, server))

    def check(self) -> None:
        """Raise StopRequested on a signal; restart children and watched processes that died
        (ChildExited when one cannot be)."""
        if self.stop_signal is not None:
            raise StopRequested()
        restarting = {name for _, name, _ in self.pending_watched}
        exited = [(spec, proc, proc.poll()) for spec, proc in self.children if proc.poll() is not None]
        watched = [(name, server, server.process.poll()) for name, server in self.watched
                   if name not in restarting and server.process.poll() is not None]
        if exited or watched:
            # A terminal Ctrl-C may reach a shared-group process (redis) a moment before we
            # see the signal ourselves: give the signal a chance to arrive first.
            time.sleep(0.2)
            if self.stop_signal is not None:
                raise StopRequested()
        for name, server, code in watched:
            self._on_watched_death(name, server, ChildExited(name, server.process.pid, code))
        for spec, proc, code in exited:
            self._on_death(spec, proc, code)
        now = time.monotonic()
        for entry in [e for e in self.pending_watched if e[0] <= now]:
            self.pending_watched.remove(entry)
            self._restart_watched(entry[1], entry[2])
        due = [(when, spec) for when, spec in self.pending_restarts if when <= now]
        for entry in due:
            self.pending_restarts.remove(entry)
            self.num_restarts += 1
            self.start(entry[1])

    def _record_death(self, name: str) -> tuple[int, float]:
        """(deaths of `name` within the window, this one included; backoff before its restart)."""
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(name, []) if now - t < self.restart_window] + [now]
        self.deaths[name] = deaths
        return len(deaths), min(10.0, 0.5 * 2 ** (len(deaths) - 1))

    def _on_death(self, spec: ChildSpec, proc: subprocess.Popen, code: int) -> None:
        self.children.remove((spec, proc))
        if code == USAGE_ERROR:
            # argparse's exit status for a bad command line: a restart would fail the same way
            raise ChildExited(spec.name, proc.pid, code, "its command line was refused (see its message "
                              "above); not restarting it")
        death = ChildExited(spec.name, proc.pid, code)
        count, delay = self._record_death(spec.name)
        if count > self.max_restarts:
            self.log(f"{death}: it died {count} times within {self.restart_window:g}s; giving up on it")
            pool_left = any(s.role == spec.role for s, _ in self.children) or any(
                s.role == spec.role for _, s in self.pending_restarts)
            if spec.role == "gateway" or not pool_left:
                raise death
            return
        self.log(f"{death}; restarting it in {delay:g}s")
        self.pending_restarts.append((time.monotonic() + delay, spec))

    def _on_watched_death(self, name: str, server: Restartable, death: Exception) -> None:
        count, delay = self._record_death(name)
        if count > self.max_restarts:
            raise ChildExited(name, server.process.pid, server.process.returncode or 0,
                              f"died {count} times within {self.restart_window:g}s; giving up on it")
        self.log(f"{death}; restarting it in {delay:g}s (same port and settings; it comes back "
                 "empty: requests in flight may fail, new ones are served once it is up)")
        self.pending_watched.append((time.monotonic() + delay, name, server))

    def _restart_watched(self, name: str, server: Restartable) -> None:
        try:
            server.restart()
        except (RuntimeError, OSError) as exc:  # e.g. its port was taken meanwhile: a death too
            self._on_watched_death(name, server, RuntimeError(f"{name} did not restart ({exc})"))
            return
        self.num_restarts += 1
        self.log(f"restarted {name} (pid {server.process.pid})")

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def stop_all(self) -> None:
        """SIGTERM the gateway, then the workers; wait up to stop_timeout; SIGKILL what is left."""
        if not self.children:
            return
        deadline = time.monotonic() + self.stop_timeout
        gateways = [(s, p) for s, p in self.children if s.role == "gateway"]
        workers = [(s, p) for s, p in self.children if s.role != "gateway"]
        for group in (gateways, workers):
            for _spec, proc in group:
                if proc.poll() is None:
                    _kill(proc, signal.SIGTERM)
            _wait_all(group, min(deadline, time.monotonic() + self.stop_timeout / 2)
                      if group is gateways else deadline)
        for spec, proc in self.children:
            if proc.poll() is None:
                self.log(f"{spec.name} (pid {proc.pid}) did not stop in {self.stop_timeout:g}s: SIGKILL")
                _kill(proc, signal.SIGKILL)
        for _spec, proc in self.children:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _kill(proc: subprocess.Popen, sig: int) -> None:
    """Signal a child's whole process group (it may have started helpers of its own)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _wait_all(group: list[tuple[ChildSpec, subprocess.Popen]], deadline: float) -> None:
    for _spec, proc in group:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


# --------------------------------------------------------------------------------------------
# Readiness
# --------------------------------------------------------------------------------------------
