"""How often a worker polls its shards' counts: the poll interval while cells arrive, backing off when they stop."""

from __future__ import annotations


class PollSchedule:
    """The wait between two count polls.

    ``fast`` while cells arrive; once none has been found for ``slowest`` seconds, the wait doubles at
    each poll that finds none, up to ``slowest``. A poll that finds nothing right after one that found
    cells is the normal case of a modest write rate: backing off at once would make the next cells wait
    two or four intervals.
    """

    def __init__(self, fast: float, slowest: float) -> None:
        self.fast, self.slowest = fast, slowest
        self.interval = fast
        self._active_at = float("-inf")

    def polled(self, now: float, *, active: bool) -> float:
        """Note a poll at ``now`` (``active``: it found cells, or some are under way); the next wait."""
        if active or now - self._active_at < self.slowest:
            if active:
                self._active_at = now
            self.interval = self.fast
        else:
            self.interval = min(self.interval * 2, self.slowest)
        return self.interval
