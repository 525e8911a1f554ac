"""Servers measured against each other in one run, the way every serving benchmark here does it.

At each case (a client count, or a workload and a client count) `baton bench serve` runs against
each server in turn, the order reversed every other round, so that a shared VM's slow minutes fall
on all of them alike; each figure is the median over the rounds. A server is either up for the
whole run (`baton serve`: an idle one costs little) or started anew for each case (llama-server,
whose slots are sized to the client count).
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

Server = tuple[int, subprocess.Popen]  # (port, process)


@dataclass(frozen=True)
class Target:
    tag: str
    start: Callable[[Hashable | None], Server]  # the case for a per-case server, None otherwise
    per_case: bool = False  # started anew for each case (and stopped after it)


def measure(targets: Sequence[Target], cases: Sequence[Hashable], rounds: int,
            run: Callable[[int, Hashable, int, str], dict], describe: Callable[[str, Hashable, dict], str],
            stop: Callable[[subprocess.Popen], None]) -> dict[tuple[str, Hashable], dict[str, float]]:
    """run(port, case, round, label) -> bench serve's result (every server of a round gets the same
    prompts, each round others: a round must not measure the prefix cache the last one filled);
    returns (tag, case) -> the median over rounds of every numeric figure of the results."""
    results: dict[tuple[str, Hashable], list[dict]] = {}
    whole_run: dict[str, Server] = {}
    try:
        for target in targets:
            if not target.per_case:
                whole_run[target.tag] = target.start(None)
        for case in cases:
            this_case: dict[str, Server] = {}
            try:
                for target in targets:
                    if target.per_case:
                        this_case[target.tag] = target.start(case)
                for round_ in range(rounds):
                    for target in (targets if round_ % 2 == 0 else targets[::-1]):
                        port = (whole_run | this_case)[target.tag][0]
                        result = run(port, case, round_, f"{target.tag}{round_}")
                        results.setdefault((target.tag, case), []).append(result)
                        print(describe(target.tag, case, result), flush=True)
            finally:
                for _, proc in this_case.values():
                    stop(proc)
    finally:
        for _, proc in whole_run.values():
            stop(proc)
    return {key: {name: statistics.median(r[name] for r in runs)
                  for name, value in runs[0].items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
            for key, runs in results.items()}
