"""``StoreOptions``: every option of a :class:`~paramstore.ParamStore`, in one frozen, validated object.

``ParamStore(root, options)`` takes one (or a plain mapping, as a framework's YAML config holds
it), and keyword arguments override its fields: ``ParamStore(root, retention=KeepLast(2))`` is
``ParamStore(root, StoreOptions(retention=KeepLast(2)))``. Every field is checked when the object is
made (InvalidArgumentError naming the field), so a bad option fails before anything is opened.
The table in ``docs/options.md`` lists the same fields (a test keeps the two equal).

Example:
    >>> opts = StoreOptions.from_dict({"shard_size_bytes": 1 << 20, "retention": {"keep_last": 2}})
    >>> opts.shard_size_bytes, opts.retention
    (1048576, {'local': KeepLast(n=2)})
    >>> StoreOptions.from_dict({"shard_size": 1})
    Traceback (most recent call last):
    ...
    paramstore.errors.InvalidArgumentError: unknown store option 'shard_size' (did you mean 'shard_size_bytes'?); known: ...
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from .errors import InvalidArgumentError
from .metrics import check_available
from .persist import DEFAULT_BACKLOG, check_backlog
from .retention import AnyOf, KeepBest, KeepEvery, KeepLast, KeepTagged, KeepWithin, Policy, infer_mode
from .scrub import check_rate
from .validate import check_timeout
from .writer import check_run_id

if TYPE_CHECKING:
    import torch

    from .remote import Remote

__all__ = ["StoreOptions", "DEFAULT_SHARD_SIZE_BYTES", "policy_from_spec"]

DEFAULT_SHARD_SIZE_BYTES = 256 << 20
#: The tiers a retention mapping may name.
TIERS = ("local", "remote")
_SPEC_KEYS = ("keep_last", "keep_every", "keep_best", "keep_tagged", "keep_within")


@dataclass(frozen=True)
class StoreOptions:
    """How a store is opened, written and read (see ``docs/options.md`` for the table).

    Opening:
        create: True: create the store now if missing; False: it must exist now (else
            NotAStoreError); None (default): open it if it exists, else the first commit creates it.
        registry: None for the single-host LMDB registry in ``root/meta``, or a URL such as
            ``redis://[:password@]host:port/db``: a registry shared by the hosts of a store.
        name: with a shared registry, the store's name there (required: every host of one store
            passes the same name; stores sharing a server differ by name).
        shared_group: create the root as a group store (``3770``: its group's members read, lease
            and check out; only its owner commits) instead of private (``0700``).

    Writing:
        run_id: this trainer's name as the store's writer (default: host and a random suffix).
            A second process that commits while the first lives is refused (WriterConflictError).
        takeover: commit even though another live writer holds the store.
        shard_size_bytes: target size of one object (a tensor larger than this gets its own).
        group_timeout: seconds the ranks of a sharded commit wait for each other.
        prepare_buffers: after each commit (and each checkout that fetched from peers or
            patches, or derived a recipe's objects), make and fault the next version's
            shared-memory buffers in the background (two spare model sizes of shared memory, and
            one of the derived objects' sizes) so the next copy, fetch, rebuild or derivation
            writes at memory speed. False: none; rebuilds from patches and derivations then write
            new files (the least CPU per update, no spare memory; see
            :func:`paramstore.delta.rebuild`, :func:`paramstore.derived.derive_manifest`).
        recycle_buffers: with retention (and ``prepare_buffers``), GC hands pruned versions'
            objects back as the next commits' buffers (and a collective checkout's receiving
            buffers), once no other process has them open or mapped.
        pin_memory: page-lock commit slabs when this process commits accelerator tensors, so
            device-to-host copies are asynchronous DMA. False: never.
        patches: make and use sparse patches between versions (see :mod:`paramstore.delta`).
            None (default): on with a shared registry or a remote, off for a single-host store.
        device_latest: keep the latest version this process commits in a GPU's memory too and
            share it through CUDA IPC (True: the current CUDA device; or ``"cuda:0"``; None/False:
            off). Raises DeviceError without CUDA.
        device_bucket_bytes: size of one host-to-device copy of a device checkout (None: 64 MiB).
        derive: recipe names (:mod:`paramstore.recipes`, e.g. ``("fp8-block128",)``) the
            committing process derives each version it commits into, in the background once the
            version is visible (the newest first: a burst of commits derives the last one), so
            that readers, on this host or, through a shared registry, on others, find the
            derived objects made instead of deriving them.

    Keeping:
        retention: a policy (for the shared-memory tier), ``{"local": policy, "remote": policy}``,
            or the same as plain data (:func:`policy_from_spec`): prune and GC then run in the
            background after each commit, and after each checkout or prefetch that brought a
            version's bytes to this host (GC alone with a registry shared by hosts: its versions
            are pruned where they are committed). Held normalized, as ``{tier: policy}``.
        remote: an fsspec URL (``s3://bucket/prefix``, ``file:///mnt/ckpt``) or a
            :class:`~paramstore.remote.Remote`: every commit is written through to it in the
            background, and versions found only there are pulled on checkout.
        storage_options: options of the remote's filesystem (for S3: ``endpoint_url``, ``key``...).
        persist_retry_for: seconds, counted from its commit, that a version's upload is retried
            through transient remote failures.
        persist_backlog: how many committed versions may wait for upload besides the one being
            pushed (see :mod:`paramstore.persist` for what is skipped when it is full).
        scrub_rate: re-hash this host's objects in the background at this many bytes per second,
            quarantining any found damaged; None (default): no scrub.

    Observing:
        metrics: record Prometheus metrics of this store's operations in this process
            (:mod:`paramstore.metrics`; needs the ``metrics`` extra, else InvalidArgumentError).
    """

    create: bool | None = None
    registry: str | None = None
    name: str | None = None
    shared_group: bool = False
    run_id: str | None = None
    takeover: bool = False
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES
    group_timeout: float = 600.0
    prepare_buffers: bool = True
    recycle_buffers: bool = True
    pin_memory: bool = True
    patches: bool | None = None
    device_latest: "bool | str | torch.device | None" = None
    device_bucket_bytes: int | None = None
    derive: tuple[str, ...] = ()
    retention: Any = None
    remote: "str | Remote | None" = None
    storage_options: Mapping[str, Any] | None = field(default=None, hash=False)
    persist_retry_for: float = 900.0
    persist_backlog: int = DEFAULT_BACKLOG
    scrub_rate: float | None = None
    metrics: bool = False

    def __post_init__(self) -> None:
        for name in ("create", "patches"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        for name in ("shared_group", "takeover", "prepare_buffers", "recycle_buffers", "pin_memory", "metrics"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _positive_int("shard_size_bytes", self.shard_size_bytes)
        if self.device_bucket_bytes is not None:
            _positive_int("device_bucket_bytes", self.device_bucket_bytes)
        if isinstance(self.derive, str) or not isinstance(self.derive, (tuple, list)) \
                or not all(isinstance(r, str) and r for r in self.derive) or len(set(self.derive)) != len(self.derive):
            raise InvalidArgumentError(f"derive must be a list of distinct recipe names, got {self.derive!r}")
        object.__setattr__(self, "derive", tuple(self.derive))
        if self.registry is not None and not self.name:
            raise InvalidArgumentError("a shared registry needs name=: the store's name, the same on every host")
        if self.storage_options is not None and not isinstance(self.remote, str):
            raise InvalidArgumentError("storage_options= configures the filesystem of remote=URL; pass them together "
                                       "(a Remote object carries its own options)")
        if self.run_id is not None:
            check_run_id(self.run_id)
        check_timeout(self.group_timeout, "group_timeout")
        if check_timeout(self.persist_retry_for, "persist_retry_for") is None:
            raise InvalidArgumentError("persist_retry_for must be a non-negative number of seconds, got None")
        check_backlog(self.persist_backlog)
        check_rate(self.scrub_rate)
        if self.metrics:
            check_available()  # prometheus_client: the paramstore[metrics] extra
        if self.device_latest is not None and self.device_latest is not False:
            from .device import check_device_latest  # (torch: only for a store that keeps a device copy)

            object.__setattr__(self, "device_latest", check_device_latest(self.device_latest))
        policies = _tier_policies(self.retention)
        if "remote" in policies and self.remote is None:
            raise InvalidArgumentError("retention for the 'remote' tier needs remote=URL")
        object.__setattr__(self, "retention", policies or None)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> "StoreOptions":
        """Options from a plain mapping (a framework config passed through); an unknown key is an
        InvalidArgumentError that names the closest known one."""
        if not isinstance(options, Mapping):
            raise InvalidArgumentError(f"store options must be a mapping of option names to values, got {options!r}")
        known = [f.name for f in fields(cls)]
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidArgumentError(f"unknown store option {key!r}{hint}; known: {', '.join(known)}")
        return cls(**options)

    @classmethod
    def build(cls, options: "StoreOptions | Mapping[str, Any] | None", overrides: Mapping[str, Any]) -> "StoreOptions":
        """``options`` (an object, a mapping or None) with ``overrides`` (keyword arguments) applied."""
        if options is None or isinstance(options, Mapping):
            return cls.from_dict({**(options or {}), **overrides})
        if not isinstance(options, StoreOptions):
            raise InvalidArgumentError(f"options must be StoreOptions, a mapping or None, got {options!r}")
        if overrides:
            cls.from_dict(overrides)  # unknown names refused with a hint
            return dataclasses.replace(options, **overrides)
        return options

    @property
    def policies(self) -> dict[str, Policy]:
        """The retention policy of each tier that has one (``{}``: no background retention)."""
        return dict(self.retention or {})

    @property
    def use_patches(self) -> bool:
        """Whether patches are made and used: ``patches``, else on where bytes cross links."""
        return self.patches if self.patches is not None else (self.registry is not None or self.remote is not None)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def _tier_policies(retention: object) -> dict[str, Policy]:
    """``retention`` as ``{tier: policy}``: one policy or spec (the local tier), or one per tier."""
    if retention is None:
        return {}
    if isinstance(retention, Policy):
        return {"local": retention}
    if isinstance(retention, Mapping) and retention and all(k in TIERS for k in retention):
        return {tier: policy_from_spec(p, f"retention[{tier!r}]") for tier, p in retention.items()}
    if isinstance(retention, Mapping):
        return {"local": policy_from_spec(retention)}
    raise InvalidArgumentError(f"retention must be a policy, a spec mapping, or a mapping of tier names "
                               f"({', '.join(TIERS)}) to those, got {retention!r}")


def policy_from_spec(spec: object, what: str = "retention") -> Policy:
    """A retention policy from plain data (a policy is returned as it is); several rules keep a
    version if any keeps it (:class:`~paramstore.retention.AnyOf`).

    Keys: ``keep_last`` (int), ``keep_every`` (int), ``keep_best`` (``{"n", "metric", "mode"}``;
    ``mode`` may be left out for a well-known metric such as ``reward`` or ``loss``),
    ``keep_tagged`` (a list of tags; empty: every tagged version), ``keep_within`` (seconds or
    ``"2h"``).

    Example:
        >>> policy_from_spec({"keep_last": 3, "keep_best": {"n": 1, "metric": "reward"}})
        AnyOf(policies=(KeepLast(n=3), KeepBest(n=1, metric='reward', mode='max', keep_without_metric=False)))
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, Mapping) or not spec:
        raise InvalidArgumentError(f"{what} must be a policy or a non-empty mapping of {', '.join(_SPEC_KEYS)}, "
                                   f"got {spec!r}")
    rules: list[Policy] = []
    for key, value in spec.items():
        if key == "keep_last":
            rules.append(KeepLast(value))
        elif key == "keep_every":
            rules.append(KeepEvery(value))
        elif key == "keep_best":
            rules.append(_keep_best(value, what))
        elif key == "keep_tagged":
            if not isinstance(value, (list, tuple)):
                raise InvalidArgumentError(f"{what}: keep_tagged is a list of tags (empty: every tag), got {value!r}")
            rules.append(KeepTagged(*value))
        elif key == "keep_within":
            rules.append(KeepWithin(value))
        else:
            close = difflib.get_close_matches(str(key), _SPEC_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidArgumentError(f"{what}: unknown rule {key!r}{hint}; known: {', '.join(_SPEC_KEYS)}")
    return rules[0] if len(rules) == 1 else AnyOf(*rules)


def _keep_best(value: object, what: str) -> KeepBest:
    if not isinstance(value, Mapping) or set(value) - {"n", "metric", "mode"} or "metric" not in value:
        raise InvalidArgumentError(f"{what}: keep_best is {{'n': int, 'metric': name, 'mode': 'max'|'min'}}, "
                                   f"got {value!r}")
    mode = value.get("mode") or infer_mode(value["metric"])
    if mode is None:
        raise InvalidArgumentError(f"{what}: keep_best cannot tell whether a higher or a lower {value['metric']!r} "
                                   "is better: add 'mode': 'max' or 'min'")
    return KeepBest(value.get("n", 1), value["metric"], mode=mode)
