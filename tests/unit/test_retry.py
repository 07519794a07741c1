"""The retry policy: exponential delays with bounded jitter, caps, and what counts as transient."""

from __future__ import annotations

import pytest

from pipeline.errors import PayloadInvalid, PermanentError, TransientError
from pipeline.retry import RetryPolicy


def test_delays_double_from_the_base_and_are_capped() -> None:
    policy = RetryPolicy(base_delay=2, max_delay=20, jitter=0)
    assert [policy.delay(n) for n in range(6)] == [2, 4, 8, 16, 20, 20]


def test_jitter_stays_within_its_fraction() -> None:
    policy = RetryPolicy(base_delay=2, jitter=0.2)
    samples = [policy.delay(1) for _ in range(500)]
    assert min(samples) >= 3.2 and max(samples) <= 4.8
    assert max(samples) - min(samples) > 0.5  # it does spread


def test_five_attempts_mean_four_retries() -> None:
    assert RetryPolicy().max_retries == 4


def test_transient_and_permanent() -> None:
    policy = RetryPolicy(transient=(ConnectionError, TimeoutError))
    assert policy.is_transient(TransientError("x"))
    assert policy.is_transient(ConnectionRefusedError())
    assert not policy.is_transient(PermanentError("x"))
    assert not policy.is_transient(PayloadInvalid("t", []))
    assert not policy.is_transient(ValueError("x"))


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"base_delay": -1}, {"base_delay": 10, "max_delay": 5}, {"jitter": 1.0}, {"max_delay": 7200}],
)
def test_invalid_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must|capped"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
