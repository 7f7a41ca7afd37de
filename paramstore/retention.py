"""Retention policies: which versions to keep. Pure data and pure functions, no I/O, no clock.

Each policy is a small frozen dataclass, validated at construction, with an English ``str()``.
``policy.keep(versions, now)`` returns, for each version it keeps, the reasons why. Policies compose
with :class:`AnyOf` (keep a version if any child keeps it; ``a | b`` is ``AnyOf(a, b)``). Whatever the policy, the store also keeps
the latest version and every leased version (see :func:`decide`).

Example:
    >>> policy = AnyOf(KeepLast(2), KeepEvery(1000), KeepBest(3, "reward"))
    >>> str(policy)
    'keep the last 2; keep every 1000th step; keep the best 3 by reward (max)'
"""

from __future__ import annotations

import abc
import difflib
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from .errors import InvalidArgumentError
from .text import warn
from .adapters import base_of
from .manifest import Version

__all__ = [
    "Policy", "KeepLast", "KeepEvery", "KeepBest", "KeepTagged", "KeepWithin", "AnyOf",
    "Decision", "decide", "parse_duration", "infer_mode", "best_rules", "missing_metrics", "check_commit_metrics",
]

Reasons = dict[int, list[str]]


class Policy(abc.ABC):
    """Base of every retention rule.

    Example:
        >>> rule = KeepLast(2) | KeepTagged("release")  # the same as AnyOf(KeepLast(2), KeepTagged("release"))
        >>> rule == AnyOf(KeepLast(2), KeepTagged("release"))
        True
    """

    @abc.abstractmethod
    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        """Steps this rule keeps, each with the reasons (``versions`` sorted by step)."""

    def __or__(self, other: "Policy") -> "AnyOf":
        return AnyOf(self, other)


def _count(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {n!r}")
    return n


@dataclass(frozen=True)
class KeepLast(Policy):
    """Keep the ``n`` newest versions.

    Example:
        >>> versions = [Version(step, created_at=0.0, nbytes=0, digest="", num_tensors=0) for step in (10, 20, 30)]
        >>> KeepLast(2).keep(versions, now=0.0)
        {20: ['one of the last 2'], 30: ['one of the last 2']}
    """

    n: int

    def __post_init__(self) -> None:
        _count("KeepLast(n)", self.n)

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        chosen = versions[-self.n :] if self.n else []
        return {v.step: [f"one of the last {self.n}"] for v in chosen}

    def __str__(self) -> str:
        return f"keep the last {self.n}"


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Keep versions whose step is divisible by ``steps``.

    Example:
        >>> versions = [Version(step, created_at=0.0, nbytes=0, digest="", num_tensors=0) for step in (500, 1000, 1500)]
        >>> KeepEvery(1000).keep(versions, now=0.0)
        {1000: ['step divisible by 1000']}
        >>> str(KeepEvery(1000))
        'keep every 1000th step'
    """

    steps: int

    def __post_init__(self) -> None:
        if _count("KeepEvery(steps)", self.steps) == 0:
            raise InvalidArgumentError("KeepEvery(steps) must be positive")

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        return {v.step: [f"step divisible by {self.steps}"] for v in versions if v.step % self.steps == 0}

    def __str__(self) -> str:
        n = self.steps
        suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        return f"keep every {n}{suffix} step"


#: Words that make a metric's direction known (see :func:`infer_mode`).
LOWER_IS_BETTER = frozenset({"loss", "error", "err", "perplexity", "ppl", "nll", "mse", "mae", "rmse", "wer", "cer",
                             "regret", "cost"})
HIGHER_IS_BETTER = frozenset({"reward", "return", "accuracy", "acc", "score", "f1", "bleu", "rouge", "auc",
                              "precision", "recall"})
_NEGATION = frozenset({"neg", "negative", "minus", "inv", "inverse"})


def infer_mode(metric: str) -> str | None:
    """``"min"`` or ``"max"`` when ``metric``'s name says which way is better, else None.

    The name is split into words (``val/loss``, ``eval_loss``, ``valLoss``, ``loss2``); a word of
    :data:`LOWER_IS_BETTER` means ``"min"``, one of :data:`HIGHER_IS_BETTER` ``"max"``. Words of
    both kinds, or a negation (``neg_loss``), make the name ambiguous (None).

    Example:
        >>> infer_mode("val/loss"), infer_mode("episode_reward"), infer_mode("neg_loss"), infer_mode("entropy")
        ('min', 'max', None, None)
    """
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", metric).lower()
    words = set(re.findall(r"[a-z0-9]+", spaced)) | set(re.findall(r"[a-z]+", spaced))
    lower, higher = bool(words & LOWER_IS_BETTER), bool(words & HIGHER_IS_BETTER)
    if lower == higher or words & _NEGATION:
        return None
    return "min" if lower else "max"


@dataclass(frozen=True)
class KeepBest(Policy):
    """Keep the ``n`` best versions by ``metric`` (``mode="max"``: higher is better; ``"min"``: lower).

    Without ``mode`` the direction comes from the metric's name (:func:`infer_mode`: ``loss`` ranks
    by min, ``reward`` by max); a name that says neither needs ``mode=`` (InvalidArgumentError
    otherwise, as the CLI's ``--keep-best`` needs ``--mode``).
    Versions without the metric are kept when ``keep_without_metric`` is true, else not ranked:
    while no version has the metric (a run that evaluates every 100 steps) this rule keeps
    nothing, and the other rules of an :class:`AnyOf` apply as usual. A misspelt metric is caught
    where it is given: ``ParamStore.commit(metrics=)`` refuses a commit whose metrics hold a close
    match of a metric no version has (see :func:`check_commit_metrics`), and an explicit prune
    refuses a policy ranking by a metric no version has (:func:`missing_metrics`).

    Example:
        >>> versions = [Version(step, created_at=0.0, nbytes=0, digest="", num_tensors=0, metrics={"loss": loss})
        ...             for step, loss in [(1, 0.9), (2, 0.4), (3, 0.6)]]
        >>> KeepBest(1, "loss").keep(versions, now=0.0)
        {2: ['best 1 by loss (min)']}
        >>> KeepBest(1, "reward").keep(versions, now=0.0)  # no version has it: nothing ranked
        {}
    """

    n: int
    metric: str
    mode: str | None = None  # resolved in __post_init__: always "max" or "min" afterwards
    keep_without_metric: bool = False

    def __post_init__(self) -> None:
        _count("KeepBest(n)", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidArgumentError(f"KeepBest metric must be a non-empty string, got {self.metric!r}")
        if self.mode is None:
            inferred = infer_mode(self.metric)
            if inferred is None:
                raise InvalidArgumentError(f"KeepBest({self.n}, {self.metric!r}): the name does not say which way is "
                                           "better; pass mode='max' (higher is better) or mode='min' (lower is better)")
            object.__setattr__(self, "mode", inferred)
        if self.mode not in ("max", "min"):
            raise InvalidArgumentError(f"KeepBest mode must be 'max' or 'min', got {self.mode!r}")

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        ranked = [v for v in versions if self.metric in v.metrics]
        sign = -1.0 if self.mode == "max" else 1.0
        ranked.sort(key=lambda v: (sign * v.metrics[self.metric], -v.step))
        out: Reasons = {v.step: [f"best {i + 1} by {self.metric} ({self.mode})"] for i, v in enumerate(ranked[: self.n])}
        if self.keep_without_metric:
            for v in versions:
                if self.metric not in v.metrics:
                    out.setdefault(v.step, []).append(f"has no {self.metric} metric")
        return out

    def __str__(self) -> str:
        return f"keep the best {self.n} by {self.metric} ({self.mode})"


@dataclass(frozen=True)
class KeepTagged(Policy):
    """Keep versions carrying any of ``tags`` (no argument: any tag at all).

    A policy passed to the Python API (``ParamStore(retention=...)``, ``store.prune(policy)``) keeps
    exactly what it says: tagged versions are protected only by a ``KeepTagged`` in it (e.g.
    ``KeepLast(2) | KeepTagged()``), so that a run that tags often cannot fill shared memory
    unawares. The CLI's ``prune`` adds ``KeepTagged()`` itself unless given ``--prune-tagged``.

    Example:
        >>> versions = [Version(1, 0.0, 0, "", 0, tags=("release",)), Version(2, 0.0, 0, "", 0, tags=("wip",))]
        >>> KeepTagged("release").keep(versions, now=0.0)
        {1: ['tagged release']}
        >>> sorted(KeepTagged().keep(versions, now=0.0))
        [1, 2]
    """

    tags: tuple[str, ...] = ()

    def __init__(self, *tags: str) -> None:
        for t in tags:
            if not isinstance(t, str) or not t:
                raise InvalidArgumentError(f"KeepTagged takes tag names, got {t!r}")
        object.__setattr__(self, "tags", tuple(tags))

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        out: Reasons = {}
        for v in versions:
            hit = [t for t in v.tags if not self.tags or t in self.tags]
            if hit:
                out[v.step] = [f"tagged {', '.join(hit)}"]
        return out

    def __str__(self) -> str:
        return f"keep versions tagged {', '.join(self.tags)}" if self.tags else "keep tagged versions"


@dataclass(frozen=True)
class KeepWithin(Policy):
    """Keep versions created within ``seconds`` of the newest version (``"2h"``, ``"30m"``, ``90``).

    Measured from the newest version, not from the clock, so a paused run keeps its recent history.

    Example:
        >>> hour = 3600.0
        >>> versions = [Version(step, created_at=step * hour, nbytes=0, digest="", num_tensors=0)
        ...             for step in (1, 2, 3, 4)]
        >>> KeepWithin("2h").keep(versions, now=0.0)
        {2: ['within 2h of the newest'], 3: ['within 2h of the newest'], 4: ['within 2h of the newest']}
    """

    seconds: float

    def __init__(self, duration: float | str) -> None:
        object.__setattr__(self, "seconds", parse_duration(duration))

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        if not versions:
            return {}
        newest = max(v.created_at for v in versions)
        return {v.step: [f"within {_fmt(self.seconds)} of the newest"] for v in versions
                if newest - v.created_at <= self.seconds}

    def __str__(self) -> str:
        return f"keep versions within {_fmt(self.seconds)} of the newest"


@dataclass(frozen=True)
class AnyOf(Policy):
    """Keep a version if any of ``policies`` keeps it.

    Example:
        >>> str(AnyOf(KeepLast(2), KeepTagged("release")))
        'keep the last 2; keep versions tagged release'
    """

    policies: tuple[Policy, ...] = field(default_factory=tuple)

    def __init__(self, *policies: Policy) -> None:
        if not policies:
            raise InvalidArgumentError("AnyOf() needs at least one policy: an empty policy would delete everything")
        for p in policies:
            if not isinstance(p, Policy):
                raise InvalidArgumentError(f"AnyOf() takes policies, got {p!r}")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, versions: Sequence[Version], now: float) -> Reasons:
        out: Reasons = {}
        for p in self.policies:
            for step, why in p.keep(versions, now).items():
                out.setdefault(step, []).extend(why)
        return out

    def __str__(self) -> str:
        return "; ".join(str(p) for p in self.policies)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(duration: float | str) -> float:
    """Seconds in ``duration``: a number, or text like ``"90"``, ``"90s"``, ``"2h"``, ``"1d12h"``.

    Example:
        >>> parse_duration("1d12h"), parse_duration("90s"), parse_duration(30)
        (129600.0, 90.0, 30.0)
    """
    if isinstance(duration, bool):
        raise InvalidArgumentError(f"bad duration {duration!r}")
    if isinstance(duration, (int, float)):
        if duration < 0:
            raise InvalidArgumentError(f"duration must not be negative, got {duration}")
        return float(duration)
    if isinstance(duration, str):
        text = duration.strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            return float(text)
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(n) * _UNITS[u] for n, u in parts)
    raise InvalidArgumentError(f"cannot parse duration {duration!r}; use seconds or e.g. '90s', '30m', '2h', '1d12h'")


def _fmt(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Decision:
    """What a prune keeps and removes, with reasons for every kept version."""

    keep: Mapping[int, list[str]]
    remove: list[int]


def decide(policy: Policy, versions: Iterable[Version], leased: Iterable[int], now: float, *,
           hold: Mapping[int, list[str]] | None = None) -> Decision:
    """Apply ``policy``, then always keep the latest version and every leased one; ``hold``: steps
    kept besides (with their reasons, for those nothing else keeps: what the remote still awaits);
    and the base of every adapter version kept (:mod:`paramstore.adapters`).

    Example:
        >>> versions = [Version(step, created_at=0.0, nbytes=0, digest="", num_tensors=0) for step in (1, 2, 3, 4)]
        >>> d = decide(KeepLast(1), versions, leased=[2], now=0.0)
        >>> d.keep
        {2: ['leased'], 4: ['one of the last 1', 'latest']}
        >>> d.remove
        [1, 3]
    """
    vs = sorted(versions, key=lambda v: v.step)
    kept = policy.keep(vs, now)
    if vs:
        kept.setdefault(vs[-1].step, []).append("latest")
    present = {v.step for v in vs}
    for s in sorted(set(leased) & present):
        kept.setdefault(s, []).append("leased")
    for s, why in (hold or {}).items():
        if s in present and s not in kept:
            kept[s] = list(why)
    for v in vs:  # the base of every adapter version kept (an adapter's base is never an adapter)
        base = base_of(v.metadata)
        if v.step in kept and base in present:
            kept.setdefault(base, []).append(f"base of adapter version {v.step}")
    return Decision(dict(sorted(kept.items())), [v.step for v in vs if v.step not in kept])


def best_rules(policy: Policy) -> list[KeepBest]:
    """The :class:`KeepBest` rules of ``policy``, inside :class:`AnyOf` too.

    Example:
        >>> [r.metric for r in best_rules(KeepLast(2) | KeepBest(1, "reward") | KeepBest(1, "loss"))]
        ['reward', 'loss']
    """
    if isinstance(policy, KeepBest):
        return [policy]
    if isinstance(policy, AnyOf):
        return [r for p in policy.policies for r in best_rules(p)]
    return []


def missing_metrics(policy: Policy, versions: Iterable[Version]) -> list[str]:
    """Metrics ``policy`` ranks by that none of ``versions`` has (none when there are no versions).

    An explicit prune refuses such a policy (a misspelt ``--metric``); background retention does
    not (versions without a metric are simply not ranked).

    Example:
        >>> versions = [Version(1, 0.0, 0, "", 0, metrics={"reward": 0.5})]
        >>> missing_metrics(KeepLast(1) | KeepBest(1, "rewrd", mode="max") | KeepBest(1, "reward"), versions)
        ['rewrd']
    """
    vs = list(versions)
    seen = {m for v in vs for m in v.metrics}
    return [r.metric for r in best_rules(policy) if vs and r.metric not in seen]


#: How alike a metric name must be to one a commit passes to be taken for its typo (difflib ratio).
TYPO_CUTOFF = 0.8


def check_commit_metrics(policies: Iterable[Policy], metrics: Mapping[str, float],
                         versions: Callable[[], Iterable[Version]], settled: set[str]) -> None:
    """On the trainer's thread, before a commit with ``metrics`` writes anything: question each
    metric a :class:`KeepBest` of ``policies`` ranks by that the commit does not pass and no
    version so far has (``versions()``, called only then).

    * A close match among the commit's metrics (``"rewrd"`` for ``"reward"``): InvalidArgumentError
      naming both (the run would otherwise never rank anything by that rule).
    * No close match (a metric logged later, by evaluations): a RuntimeWarning, once, that versions
      without it are not ranked by ``KeepBest`` (the policy's other rules still apply).

    ``settled`` holds the metrics that need no more checks (seen, or warned about); it is updated.

    Example:
        >>> check_commit_metrics([KeepLast(2) | KeepBest(2, "rewrd", mode="max")], {"reward": 0.5}, list, set())
        Traceback (most recent call last):
        ...
        paramstore.errors.InvalidArgumentError: retention ranks versions by 'rewrd' (keep the best 2 by rewrd (max)), \
but no version has that metric and this commit passes only 'reward': did you mean 'reward'? Fix the name in \
KeepBest or in commit(metrics=); nothing was written
    """
    if not metrics:
        return
    rules = [r for p in policies for r in best_rules(p) if r.metric not in settled]
    settled.update(r.metric for r in rules if r.metric in metrics)
    rules = [r for r in rules if r.metric not in metrics]
    if not rules:
        return
    had = {m for v in versions() for m in v.metrics}
    settled.update(r.metric for r in rules if r.metric in had)
    names = ", ".join(repr(m) for m in sorted(metrics))
    for r in rules:
        if r.metric in settled:
            continue
        close = difflib.get_close_matches(r.metric, list(metrics), n=1, cutoff=TYPO_CUTOFF)
        if close:
            raise InvalidArgumentError(
                f"retention ranks versions by {r.metric!r} ({r}), but no version has that metric and this commit "
                f"passes only {names}: did you mean {close[0]!r}? Fix the name in KeepBest or in commit(metrics=); "
                "nothing was written")
    for r in rules:
        if r.metric not in settled:
            settled.add(r.metric)
            warn(f"retention ranks versions by {r.metric!r} ({r}), but this commit passes only {names} and "
                          f"no version has {r.metric!r} yet: versions without it are not ranked by KeepBest (the "
                          "policy's other rules still apply). Pass it in commit(metrics=) when you have it; this is "
                          "said once", RuntimeWarning)
