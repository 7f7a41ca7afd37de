"""Retention policies: table-driven semantics with reasons, composition, validation."""

from __future__ import annotations

import warnings

import pytest

from paramstore import InvalidArgumentError
from paramstore.manifest import Version
from paramstore.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepTagged,
    KeepWithin,
    decide,
    infer_mode,
    missing_metrics,
    parse_duration,
)


def V(step: int, *, t: float | None = None, tags: tuple[str, ...] = (), **metrics: float) -> Version:
    return Version(step=step, created_at=1000.0 + step * 60 if t is None else t, nbytes=1, digest=f"d{step}",
                   num_tensors=1, tags=tags, metrics=metrics)


# Ten versions, steps 10..100, one a minute; reward peaks at 40 and 70; 50 is tagged "release".
HISTORY = [V(10 * i, tags=("release",) if i == 5 else (), **({"reward": r} if r is not None else {}))
           for i, r in zip(range(1, 11), [0.1, 0.2, 0.3, 0.9, 0.5, None, 0.8, 0.4, 0.2, 0.1])]

CASES = [
    # policy, leased, kept steps
    (KeepLast(1), [], [100]),
    (KeepLast(3), [], [80, 90, 100]),
    (KeepLast(0), [], [100]),  # the latest is always kept
    (KeepEvery(30), [], [30, 60, 90, 100]),
    (KeepBest(2, "reward"), [], [40, 70, 100]),
    (KeepBest(2, "reward", mode="min"), [], [10, 100]),  # ties (0.1 at 10 and 100): newest ranks first
    (KeepBest(1, "reward", keep_without_metric=True), [], [40, 60, 100]),
    (KeepTagged("release"), [], [50, 100]),
    (KeepTagged("other"), [], [100]),
    (KeepTagged(), [], [50, 100]),
    (KeepWithin("20m"), [], [80, 90, 100]),  # one version per 10 minutes
    (KeepWithin(0), [], [100]),
    (AnyOf(KeepLast(2), KeepEvery(50)), [], [50, 90, 100]),
    (AnyOf(KeepBest(1, "reward"), KeepTagged("release")), [20], [20, 40, 50, 100]),
    (KeepLast(1) | KeepEvery(40), [], [40, 80, 100]),
]


@pytest.mark.parametrize("policy,leased,kept", CASES, ids=[str(c[0]) + (" leased" if c[1] else "") for c in CASES])
def test_policy_table(policy, leased, kept):
    d = decide(policy, HISTORY, leased, now=0.0)
    assert sorted(d.keep) == kept
    assert d.remove == [v.step for v in HISTORY if v.step not in kept]
    for step, reasons in d.keep.items():
        assert reasons, f"step {step} kept without a reason"


def test_reasons_explain():
    d = decide(AnyOf(KeepLast(1), KeepBest(1, "reward")), HISTORY, [30], now=0.0)
    assert d.keep[100] == ["one of the last 1", "latest"]
    assert d.keep[40] == ["best 1 by reward (max)"]
    assert d.keep[30] == ["leased"]


def test_best_never_evicts_latest():
    # the latest has the worst reward: KeepBest(1) alone would drop it
    d = decide(KeepBest(1, "reward"), HISTORY, [], now=0.0)
    assert 100 in d.keep and "latest" in d.keep[100]


def test_str_is_english():
    assert str(AnyOf(KeepLast(2), KeepEvery(1000), KeepBest(3, "reward"))) == \
        "keep the last 2; keep every 1000th step; keep the best 3 by reward (max)"
    assert str(KeepWithin("90m")) == "keep versions within 90m of the newest"
    assert str(KeepWithin(7200)) == "keep versions within 2h of the newest"


def test_empty_history():
    assert decide(KeepLast(2), [], [], now=0.0).keep == {}


@pytest.mark.parametrize("make", [
    lambda: KeepLast(-1), lambda: KeepLast(1.5), lambda: KeepLast(True), lambda: KeepEvery(0),
    lambda: KeepBest(-2, "r"), lambda: KeepBest(1, ""), lambda: KeepBest(1, "r", mode="median"),
    lambda: KeepTagged(""), lambda: KeepWithin("two hours"), lambda: KeepWithin(-5), lambda: KeepWithin("2h30"),
    lambda: AnyOf(), lambda: AnyOf(KeepLast(1), "last"),
])
def test_bad_options(make):
    with pytest.raises(InvalidArgumentError):
        make()


def test_metric_missing_everywhere_ranks_nothing_and_the_other_rules_apply():
    # issue 24 item 2: it used to raise, which switched the whole policy off in the background
    alone = decide(KeepBest(2, "rewrd", mode="max"), HISTORY, [], now=0.0)
    assert alone.keep == {HISTORY[-1].step: ["latest"]}
    assert decide(AnyOf(KeepLast(2), KeepBest(2, "rewrd", mode="max")), HISTORY, [], now=0.0).keep == \
        decide(KeepLast(2), HISTORY, [], now=0.0).keep
    # what an explicit prune refuses
    assert missing_metrics(KeepLast(2) | KeepBest(2, "rewrd", mode="max"), HISTORY) == ["rewrd"]


@pytest.mark.parametrize("text,seconds", [("90", 90), ("2x", None), ("90s", 90), ("30m", 1800), ("2h", 7200),
                                          ("1d12h", 129600), ("1w", 604800), ("1.5h", 5400)])
def test_parse_duration(text, seconds):
    if seconds is None:
        with pytest.raises(InvalidArgumentError):
            parse_duration(text)
    else:
        assert parse_duration(text) == seconds


LOSSES = [V(step, loss=loss, entropy=loss) for step, loss in [(1, 0.9), (2, 0.4), (3, 0.6), (4, 0.8)]]


def test_keep_best_by_loss_keeps_the_lowest_loss():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a well-known metric needs no mode=, and says nothing
        policy = KeepBest(1, "loss")
    assert policy.mode == "min" and policy == KeepBest(1, "loss", mode="min")
    assert decide(policy, LOSSES, [], now=0.0).keep == {2: ["best 1 by loss (min)"], 4: ["latest"]}
    assert str(policy) == "keep the best 1 by loss (min)"


def test_keep_best_without_a_known_direction_needs_a_mode():
    with pytest.raises(InvalidArgumentError, match="mode='max'.*mode='min'"):
        KeepBest(1, "entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = KeepBest(1, "entropy", mode="max")
        assert KeepBest(1, "entropy", mode="min").mode == "min"
        assert KeepBest(1, "loss", mode="max").mode == "max"  # an explicit mode always wins
    assert sorted(decide(policy, LOSSES, [], now=0.0).keep) == [1, 4]


@pytest.mark.parametrize("metric,mode", [
    ("loss", "min"), ("val/loss", "min"), ("eval_loss", "min"), ("valLoss", "min"), ("loss2", "min"),
    ("perplexity", "min"), ("word_error_rate", "min"), ("reward", "max"), ("episode_return", "max"),
    ("val_accuracy", "max"), ("f1", "max"), ("neg_loss", None), ("reward_loss", None), ("entropy", None),
    ("kl", None), ("lossy", None),
])
def test_infer_mode(metric, mode):
    assert infer_mode(metric) == mode
