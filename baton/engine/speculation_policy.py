"""When to speculate: per step from measured step costs, per row from its recent acceptance.

Step rule (decode-only steps, the decode worker's every step): a plain step of R rows costs
`plain[R]` seconds for R tokens; a verify step of R rows and T query tokens costs `verify[R, T]`
for R + E tokens, E the accepted proposals expected from the rows' recent acceptance rates. Both
are EWMAs of measured wall times (the whole step: forward, sampling, bookkeeping) in power-of-two
buckets of R and T. Verify iff verify[R, T] / (R + E) < plain[R] / R, with the number of proposals
per row capped where that emits the most tokens per second (`choose_cap`: where the kernels turn
compute-bound at R * (1 + k) rows, two proposals per row can beat four). A bucket never measured is
explored once (plain first); a bucket where verifying lost is retried every `RETRY_STEPS` steps,
so a machine that got faster at it, or a workload that got more repetitive, is noticed. Steps that
also run prefill chunks take the general (multi-token) forward anyway, so their rows speculate
without the cost test (their proposals are a few tokens next to a chunk's hundreds).

Row rule: a row whose acceptance EWMA falls under `MIN_ACCEPTANCE` stops proposing for a backoff
that doubles each time it fails again (up to `MAX_BACKOFF` steps), and then tries again.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.25  # EWMA weight of a new step time
ROW_ALPHA = 0.3  # EWMA weight of a row's newest acceptance fraction
MIN_ACCEPTANCE = 0.15
MIN_BACKOFF, MAX_BACKOFF = 4, 256
RETRY_STEPS = 64


def bucket(n: int) -> int:
    """The power of two at or above n (1, 2, 4, ...)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class RowPolicy:
    """Whether one request proposes now, from its recent acceptance (part of its `Speculation`)."""

    acceptance: float = 1.0  # EWMA of accepted / proposed
    skip: int = 0  # steps left without proposing
    backoff: int = MIN_BACKOFF

    def may_propose(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.acceptance = (1 - ROW_ALPHA) * self.acceptance + ROW_ALPHA * accepted / proposed
        if self.acceptance < MIN_ACCEPTANCE:
            self.skip, self.backoff = self.backoff, min(MAX_BACKOFF, self.backoff * 2)
            self.acceptance = 0.5  # a fresh start after the pause, not an instant relapse
        elif accepted:
            self.backoff = MIN_BACKOFF


class StepCostModel:
    def __init__(self) -> None:
        self.plain: dict[int, float] = {}
        self.verify: dict[tuple[int, int], float] = {}
        self.lost_at: dict[tuple[int, int], int] = {}  # bucket -> step of the last decision against
        self.num_steps = 0
        self.force: bool | None = None  # tests: always (True) or never (False) speculate

    def choose_cap(self, rows: int, lengths: list[int], acceptances: list[float]) -> int:
        """A decode-only step of `rows` rows whose speculating rows propose `lengths` tokens (their
        recent acceptance rates `acceptances`): how many proposals per row to verify, 0 for a plain
        step. Each cap c gives T = rows + sum(min(n, c)) query tokens and E = sum(a * min(n, c))
        expected accepted ones; the cap with the most tokens per second, (rows + E) / verify[R, T],
        wins if it beats the plain step's rows / plain[R]. Buckets never measured are explored
        once, smallest cap first; when no cap wins, the full one is retried every RETRY_STEPS."""
        self.num_steps += 1
        top = max(lengths, default=0)
        if self.force is not None or top == 0:
            return top if self.force is not False else 0
        rb = bucket(rows)
        plain = self.plain.get(rb)
        if plain is None:
            return 0  # measure a plain step first
        best, best_rate = 0, rows / plain
        for cap in range(1, top + 1):
            tokens = rows + sum(min(n, cap) for n in lengths)
            seconds = self.verify.get((rb, bucket(tokens)))
            if seconds is None:
                return cap  # explore
            rate = (rows + sum(a * min(n, cap) for a, n in zip(acceptances, lengths))) / seconds
            if rate > best_rate:
                best, best_rate = cap, rate
        if best:
            return best
        key = (rb, bucket(rows + sum(lengths)))
        last = self.lost_at.setdefault(key, self.num_steps)
        if self.num_steps - last >= RETRY_STEPS:
            self.lost_at[key] = self.num_steps
            return top
        return 0

    def observe(self, rows: int, tokens: int, seconds: float, verified: bool) -> None:
        """A decode-only step's wall time."""
        if verified:
            key = (bucket(rows), bucket(tokens))
            old = self.verify.get(key)
            self.verify[key] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds
        else:
            rb = bucket(rows)
            old = self.plain.get(rb)
            self.plain[rb] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds
