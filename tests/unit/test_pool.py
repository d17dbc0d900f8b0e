"""Pool bookkeeping with a controlled clock: ejection back-off, health-poll tolerance."""

from __future__ import annotations

from rerank_server.scoring.transport.pool import BackendPool, Ejection


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(clock: Clock) -> BackendPool:
    return BackendPool(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        concurrency=2,
        timeout_s=1,
        kind="chat",
        ejection=Ejection(2, 5.0, 12.0),
        clock=clock,
    )


def test_ejection_backs_off_doubling_up_to_the_maximum() -> None:
    clock = Clock()
    p = pool(clock)
    e = p.endpoints[0]
    p._failed(e)
    assert e.available  # one failure is not enough
    p._failed(e)
    assert not e.available and e.ejected_until == 105.0
    assert p.due_for_probe() == []
    clock.now = 105.0
    assert p.due_for_probe() == [e]
    p.extend(e)  # the probe failed: out again, for twice as long
    assert e.ejected_until == 115.0
    clock.now = 115.0
    p.extend(e)
    assert e.ejected_until == 127.0  # capped at 12 s
    p.restore(e)
    assert e.available and e.failures_in_row == 0


def test_least_outstanding_and_rotation() -> None:
    p = pool(Clock())
    a, b = p.endpoints
    a.http.waiting = 1  # one call waiting for a's slots
    assert p._pick([]) is b
    a.http.waiting = 0
    picks = {p._pick([]).name for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {a.name, b.name}
    a.ejected_until = 1e9
    b.healthy = False
    assert p._pick([]) is None


def test_one_missed_health_poll_is_tolerated_and_answers_keep_it_up() -> None:
    clock = Clock()
    p = pool(clock)
    e = p.endpoints[0]
    assert p.note_poll(e, False)  # a saturated server may miss one poll
    clock.now += 5
    p._succeeded(e)  # ... while its calls still succeed
    assert p.note_poll(e, False)
    assert p.note_poll(e, True) and e.failed_polls == 0
    clock.now += 5
    assert p.note_poll(e, False)
    clock.now += 5
    assert not p.note_poll(e, False)  # two misses and no answer since: down
