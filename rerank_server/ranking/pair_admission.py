"""Whether a request's pairs are sent to the backend, or answered at once because the
backend's queue would not score them within the request's budget."""

from __future__ import annotations

import time

from ..domain import Degraded, DegradedCode
from ..scoring.base import Scorer

# The share of a request's budget kept as slack for the estimate's error: the per-pair
# latency it works from is a moving average, and a loaded machine adds its own delays, so
# requests admitted up to the whole budget would finish in its last few percent and a slow
# moment would run some out of time (`tests/faults/test_overload.py`).
ADMISSION_HEADROOM = 0.1
# With nothing ahead, one request whose own pairs would outlast its budget is sent this
# often; the others are answered at once.
OWN_TIME_PROBE_S = 5.0


class PairAdmission:
    """The pairs admitted and not yet back, and the decision for the next request's."""

    def __init__(self, scorer: Scorer) -> None:
        self._scorer = scorer
        # Pairs admitted to scoring and not yet come back. The backend's queue shows a
        # request's pairs only some turns of the loop after it was admitted: a burst
        # arriving together would each see the same near-empty queue, and all be
        # admitted to time out instead of being answered OVERLOADED at once.
        self._outstanding = 0
        self._last_unsure = -OWN_TIME_PROBE_S  # when a request too slow alone was sent

    @property
    def outstanding(self) -> int:
        """Pairs sent to scoring and not yet come back."""
        return self._outstanding

    def sent(self, pairs: int) -> SentPairs:
        """`pairs` go to scoring: counted outstanding until each is `back`, or until the
        `with` block ends (the request answered, given up or cancelled)."""
        return SentPairs(self, pairs)

    def refuse(self, pairs: int, budget_s: float) -> Degraded | None:
        """Why `pairs` are not sent (None: they are). OVERLOADED when, behind the pairs
        queued and in flight ahead of them, the backend would not score them within the
        budget, less the headroom. With nothing ahead the wait would be the request's
        own: one such request in `OWN_TIME_PROBE_S` is sent (its budget decides what is
        scored, and its answer corrects the estimate), the others are answered TIMEOUT
        at once. A refused request sends nothing, so refusing it as "backend busy" would
        let one slow moment (a paused backend, a cold model's first call) refuse every
        request of that size for good, the backend idle."""
        wait_s = self._scorer.estimate_s(pairs, self.outstanding)
        if wait_s <= budget_s * (1 - ADMISSION_HEADROOM):
            return None
        ahead_s = self._scorer.estimate_s(0, self.outstanding)
        if ahead_s > 0:
            return Degraded(
                DegradedCode.OVERLOADED,
                f"backend busy: about {_seconds(wait_s)} until these pairs "
                f"would be scored, {_seconds(ahead_s)} of it behind the pairs "
                f"ahead, past {1 - ADMISSION_HEADROOM:.0%} of the "
                f"{_seconds(budget_s)} budget",
            )
        now = time.monotonic()
        if now - self._last_unsure >= OWN_TIME_PROBE_S:
            self._last_unsure = now
            return None
        return Degraded(
            DegradedCode.TIMEOUT,
            f"the {_seconds(budget_s)} budget is shorter than these pairs' own "
            f"scoring time at the recent pace, about {_seconds(wait_s)} with "
            "nothing ahead: answered at once (one such request in "
            f"{OWN_TIME_PROBE_S:.0f} s is sent, to measure the pace again)",
        )


class SentPairs:
    """One request's pairs on their way to the backend, in `PairAdmission.outstanding`."""

    def __init__(self, admission: PairAdmission, pairs: int) -> None:
        self._admission = admission
        self._left = pairs

    def __enter__(self) -> SentPairs:
        self._admission._outstanding += self._left
        return self

    def back(self, pairs: int) -> None:
        """`pairs` came back (scored or failed)."""
        self._left -= pairs
        self._admission._outstanding -= pairs

    def __exit__(self, *_: object) -> None:
        self._admission._outstanding -= self._left
        self._left = 0


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
