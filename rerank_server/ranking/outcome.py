"""How scoring went for one request: the counts its summary reports, and why it degraded."""

from __future__ import annotations

from collections import Counter

from ..domain import Candidate, Degraded, DegradedCode
from ..scoring.base import Failure, PairOutcome


class ScoringOutcome:
    """Counts, failures by kind (with the first one's detail), time spent."""

    def __init__(self, submitted: int) -> None:
        self.submitted = submitted
        self.scored = 0
        self.cached = 0
        self.failures: Counter[Failure] = Counter()
        self.details: dict[Failure, str] = {}  # the first failure's detail, by kind
        self.scoring_s = 0.0

    def count(self, pair: PairOutcome) -> bool:
        """Count one pair's outcome; whether it was scored."""
        if pair.failure is None and pair.score is not None:
            self.scored += 1
            return True
        kind = pair.failure or Failure.MALFORMED
        self.failures[kind] += 1
        self.details.setdefault(kind, pair.detail)
        return False

    def degraded(self) -> Degraded | None:
        failed = sum(self.failures.values())
        if failed == 0:
            return None
        # Details name exceptions, HTTP statuses and limits, never request text.
        kinds = ", ".join(
            f"{kind.value}: {n}" + (f", {self.details[kind]}" if self.details.get(kind) else "")
            for kind, n in self.failures.most_common()
        )
        if self.scored == 0:
            main = self.failures.most_common(1)[0][0]
            return Degraded(main.degraded_code, f"all {self.submitted} pairs failed ({kinds})")
        return Degraded(
            DegradedCode.PARTIAL, f"{failed} of {self.submitted} pairs failed ({kinds})"
        )


def capped(scored: list[Candidate], tail: list[Candidate]) -> Degraded | None:
    """CAPPED when candidates beyond `max_candidates` were left unscored."""
    if not tail:
        return None
    return Degraded(
        DegradedCode.CAPPED,
        f"{len(tail)} of {len(scored) + len(tail)} candidates were not scored "
        f"(max_candidates={len(scored)}): they follow in retrieval order",
    )
