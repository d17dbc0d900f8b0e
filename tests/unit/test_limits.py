"""Per-token limits (`security/limits.py`) on a fake clock, and the tokens file that sets
them (`security/tokens.py`): names, limits, priorities, and errors that name the line and
the key, never the token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rerank_server.errors import ConfigError
from rerank_server.security import limits
from rerank_server.security.limits import (
    ANONYMOUS,
    Admission,
    Caller,
    Limiter,
    LimitExceeded,
    Limits,
    LocalCounter,
    Priority,
    Refusal,
    places,
)
from rerank_server.security.tokens import TokenSet

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock) -> tuple[Limiter, LocalCounter]:
    counter = LocalCounter(clock)
    return Limiter(counter), counter


async def admitted(limiter: Limiter, caller: Caller) -> Admission:
    outcome = await limiter.admit(caller)
    assert isinstance(outcome, Admission), outcome
    return outcome


async def test_requests_per_second_allow_a_burst_of_one_second_then_refill() -> None:
    clock = Clock()
    rated, _ = limiter(clock)
    caller = Caller("svc-a", Limits(rps=10))
    for _ in range(10):
        await admitted(rated, caller)
    refusal = await rated.admit(caller)
    assert refusal == Refusal(
        "svc-a",
        "rps",
        "token 'svc-a' is over its limit of 10 requests per second; retry after 1 s",
        1,
    )
    clock.now += 0.1  # one request's worth back
    await admitted(rated, caller)
    assert isinstance(await rated.admit(caller), Refusal)


async def test_a_refused_request_is_not_counted() -> None:
    """Refusals do not push the caller's next chance further out."""
    clock = Clock()
    rated, _ = limiter(clock)
    caller = Caller("svc-a", Limits(rps=1))
    await admitted(rated, caller)
    for _ in range(50):
        assert isinstance(await rated.admit(caller), Refusal)
    clock.now += 1.0
    await admitted(rated, caller)


async def test_pairs_per_minute_refuse_the_request_that_would_pass_and_say_when() -> None:
    clock = Clock()
    rated, _ = limiter(clock)
    caller = Caller("svc-a", Limits(pairs_per_minute=600))  # 10 pairs a second back
    admission = await admitted(rated, caller)
    assert await admission.charge_pairs(550) is None
    refusal = await admission.charge_pairs(100)
    assert refusal is not None
    assert (refusal.limit, refusal.retry_after_s) == ("pairs_per_minute", 5)  # 50 short
    assert refusal.message == (
        "token 'svc-a' is over its limit of 600 pairs per minute (this request has 100); "
        "retry after 5 s"
    )
    assert await admission.charge_pairs(50) is None  # what is left still passes
    clock.now += 10.0
    assert await admission.charge_pairs(100) is None


async def test_a_request_larger_than_the_whole_minute_passes_alone_then_waits() -> None:
    """More pairs than the minute allows is admitted when the bucket is full (it would
    otherwise never be), and its debt is paid before the next."""
    clock = Clock()
    rated, _ = limiter(clock)
    admission = await admitted(rated, Caller("svc-a", Limits(pairs_per_minute=60)))
    assert await admission.charge_pairs(90) is None
    refusal = await admission.charge_pairs(1)
    assert refusal is not None and refusal.retry_after_s == 31  # 30 in debt, then 1
    clock.now += 31.0
    assert await admission.charge_pairs(1) is None


async def test_concurrency_is_a_place_held_until_released_once() -> None:
    clock = Clock()
    rated, counter = limiter(clock)
    caller = Caller("svc-a", Limits(concurrent=2))
    first, second = await admitted(rated, caller), await admitted(rated, caller)
    refusal = await rated.admit(caller)
    assert isinstance(refusal, Refusal)
    assert refusal.message == (
        "token 'svc-a' is over its limit of 2 concurrent requests; retry after 1 s"
    )
    first.release()
    first.release()  # every way out may release: only the first counts
    assert counter.inside("svc-a:concurrent") == 1
    third = await admitted(rated, caller)
    second.release()
    third.release()
    assert counter.inside("svc-a:concurrent") == 0


async def test_a_request_refused_for_its_rate_gives_its_concurrency_place_back() -> None:
    clock = Clock()
    rated, counter = limiter(clock)
    caller = Caller("svc-a", Limits(rps=1, concurrent=5))
    held = await admitted(rated, caller)
    assert isinstance(await rated.admit(caller), Refusal)
    assert counter.inside("svc-a:concurrent") == 1
    held.release()


async def test_callers_are_counted_apart() -> None:
    clock = Clock()
    rated, _ = limiter(clock)
    a, b = Caller("svc-a", Limits(rps=1)), Caller("svc-b", Limits(rps=1))
    await admitted(rated, a)
    assert isinstance(await rated.admit(a), Refusal)
    await admitted(rated, b)


async def test_charge_pairs_reaches_the_current_call_and_raises_after_its_hook() -> None:
    rated, _ = limiter(Clock())
    admission = await admitted(rated, Caller("svc-a", Limits(pairs_per_minute=10)))
    seen: list[Refusal] = []
    admission.on_refusal = seen.append

    async def call() -> None:
        limits.current.set(admission)
        await limits.charge_pairs(8)
        await limits.charge_pairs(5)

    with pytest.raises(LimitExceeded, match="10 pairs per minute") as info:
        await asyncio.create_task(call())  # the call's own context, as gRPC's task
    assert seen == [info.value.refusal]
    await limits.charge_pairs(1000)  # no current call here: nothing to charge


def test_priorities_share_the_servers_cap() -> None:
    """Low may fill half, normal leaves a fifth to high (only when some token is high),
    and no priority is refused by an idle server."""
    assert places(10, high_reserved=True) == {
        Priority.HIGH: 10,
        Priority.NORMAL: 8,
        Priority.LOW: 5,
    }
    assert places(10, high_reserved=False)[Priority.NORMAL] == 10
    assert places(1, high_reserved=True) == {
        Priority.HIGH: 1,
        Priority.NORMAL: 1,
        Priority.LOW: 1,
    }


def tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    return str(path)


def test_tokens_file_lines_carry_names_limits_and_priorities(tmp_path: Path) -> None:
    path = tokens_file(
        tmp_path,
        "# callers\n"
        f"{TOKEN_A} name=svc-a rps=10 pairs_per_minute=6000 concurrent=4 priority=high\n"
        "\n"
        f"  {TOKEN_B}  \n",
    )
    tokens = TokenSet.load("flag-token-0123456789", path)
    assert tokens.identify(f"Bearer {TOKEN_A}") == Caller(
        "svc-a", Limits(rps=10, pairs_per_minute=6000, concurrent=4, priority=Priority.HIGH)
    )
    assert tokens.identify(f"bearer {TOKEN_B}") == Caller("token-4")  # its line
    assert tokens.identify("Bearer flag-token-0123456789") == Caller("auth-tokens-1")
    assert tokens.identify("Bearer wrong-token-0123456789") is None
    assert tokens.identify(None) is None
    assert tokens.accepts(f"Bearer {TOKEN_A}")
    assert tokens.places(10).below[Priority.NORMAL] == 8  # a high token: room kept for it


def test_without_tokens_everyone_is_the_anonymous_normal_caller() -> None:
    tokens = TokenSet.load("", "")
    assert not tokens.enabled
    assert tokens.identify(None) is ANONYMOUS
    assert not ANONYMOUS.limits.counted and ANONYMOUS.limits.priority is Priority.NORMAL
    assert tokens.places(10).below[Priority.NORMAL] == 10


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (f"{TOKEN_A} rps=0", "line 2: rps must be a whole number of at least 1"),
        (f"{TOKEN_A} pairs_per_minute=1.5", "line 2: pairs_per_minute must be a whole number"),
        (f"{TOKEN_A} concurrent=", "line 2: concurrent must be a whole number"),
        (f"{TOKEN_A} priority=urgent", "line 2: priority must be high, normal or low"),
        (f"{TOKEN_A} rpz=10", "line 2: unknown key 'rpz'"),
        (f"{TOKEN_A} Secret+Part=1", "line 2: unknown key of field 2"),
        (f"{TOKEN_A} rps=1 rps=2", "line 2: rps is given twice"),
        (f"{TOKEN_A} {TOKEN_B}", "line 2: field 2 is not key=value"),
        (f"{TOKEN_A} name=svc/a", "line 2: name must be 1 to 64 letters"),
        ("short-token rps=1", "line 2: the token must have at least 16 characters"),
    ],
)
def test_a_bad_line_is_refused_naming_its_line_and_key_never_the_token(
    tmp_path: Path, line: str, error: str
) -> None:
    path = tokens_file(tmp_path, f"# first\n{line}\n")
    with pytest.raises(ConfigError, match=error) as info:
        TokenSet.load("", path)
    message = str(info.value)
    assert "--auth-tokens-file" in message
    assert TOKEN_A not in message and TOKEN_B not in message and "short-token" not in message
    assert "Secret" not in message


def test_a_token_listed_twice_counts_once_unless_it_has_settings(tmp_path: Path) -> None:
    plain = tokens_file(tmp_path, f"{TOKEN_A}\n{TOKEN_A}\n")
    assert TokenSet.load(TOKEN_A, plain).identify(f"Bearer {TOKEN_A}") == Caller("auth-tokens-1")
    twice = tokens_file(tmp_path, f"{TOKEN_A}\n{TOKEN_A} rps=5\n")
    with pytest.raises(ConfigError, match="line 2: the same token as line 1") as info:
        TokenSet.load("", twice)
    assert TOKEN_A not in str(info.value)


def test_tokens_sharing_a_name_share_its_limits(tmp_path: Path) -> None:
    """Rotation: the old and the new token of one service, under one name, one budget."""
    same = tokens_file(tmp_path, f"{TOKEN_A} name=svc rps=5\n{TOKEN_B} name=svc rps=5\n")
    tokens = TokenSet.load("", same)
    assert tokens.identify(f"Bearer {TOKEN_A}") == tokens.identify(f"Bearer {TOKEN_B}")
    other = tokens_file(tmp_path, f"{TOKEN_A} name=svc rps=5\n{TOKEN_B} name=svc rps=6\n")
    with pytest.raises(ConfigError, match="line 2: name 'svc' is also line 1's"):
        TokenSet.load("", other)
