"""``ParamStore``: the public face of a store. Short methods that delegate.

Where bytes go: on commit, :mod:`paramstore.commit`; on checkout, :mod:`paramstore.snapshot`;
on disk, :mod:`paramstore.format` and ``paramstore.backends``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from . import maintenance, ops
from .assets import AssetsArg, model_assets, read_assets
from .checkout import Fetcher, check_checkout_args, open_snapshot
from .delta import Patcher, patch_summary
from .errors import (
    InvalidArgumentError,
    ParamStoreWarning,
    VersionNotFoundError,
    ParamStoreError,
    StepOrderError,
    StoreClosedError,
    WaitTimeoutError,
)
from .export import DEFAULT_EXPORT_SHARD_BYTES, export
from .maintenance import Maintainer, tier_policies
from .manifest import Manifest, Version
from .peer import PeerServer
from .persist import DEFAULT_BACKLOG, Persister, check_backlog
from .remote import Remote
from .reports import FetchReport, GcReport, PruneReport, TransferReport
from .retention import Policy, check_commit_metrics
from .root import MARKER, StoreRoot, VersionSpec, check_creatable, open_root
from .staging import SlabPool
from .validate import check_bound, check_metadata, check_metrics, check_step, check_tag, check_timeout
from .scrub import Scrubber, check_rate
from .writer import check_run_id, claim, new_run_id, release

from paramstore.backends.registries.base import Lease
from paramstore.backends.transports import open_transport
from paramstore.backends.transports.base import Transport
from paramstore.backends.transports.collective import TorchCollective

if TYPE_CHECKING:  # torch is imported on first use: the CLI's metadata commands start fast
    import torch

    from .device import DeviceCache, LatestExporter

    from .commit import CommitHandle, Committer
    from .snapshot import Snapshot

__all__ = ["ParamStore"]

#: How long a push waits for the patches of its version before it uploads whole objects.
PATCH_WAIT_S = 60.0


DEFAULT_SHARD_SIZE_BYTES = 256 << 20
_DEATH_POLL_S = 0.2  # how often wait_for_readers re-checks for readers that died
_STORE_POLL_S = 0.1  # how often a reader waiting for a store to be created looks for it


class ParamStore:
    """A versioned parameter store rooted at a directory (put it on ``/dev/shm``).

    Any number of processes on the host may open the same root at once.

    Args:
        root: the store directory. A missing store is created by the first :meth:`commit` (or
            :meth:`prepare`), never by a reader: reads of a store that does not exist raise
            NotAStoreError, and waits (``wait_for``, ``subscribe``, ``checkout(min_step=)``) wait
            for it to appear, then say that no store exists at that path (a typo is obvious, and
            the path is left as it was). With ``remote=`` or ``registry=`` the root is a local
            cache of a store that lives elsewhere, created on first use to pull or fetch into.
        create: True: create the store now if missing; False: it must exist now (else
            NotAStoreError); None (default): open it if it exists, else the first commit creates it.
        run_id: this trainer's name as the store's writer (default: host and a random suffix).
            Only one writer commits to a store: a second process that commits while the first
            lives is refused with WriterConflictError (see :mod:`paramstore.writer`); each
            version records its writer's run id (``Version.writer``).
        takeover: commit even though another live writer holds the store (it is refused from
            then on).
        shared_group: create the root as a group store (``3770``: its group's members read, lease
            and check out; only its owner commits; see :mod:`paramstore.root`) instead of private (``0700``).
        group_timeout: seconds the ranks of a sharded commit wait for each other (a rank that
            dies is noticed at once; one that stops without dying, after this long).
        scrub_rate: re-hash this host's objects in the background at this many bytes per second
            (on average), quarantining any found damaged (see :mod:`paramstore.scrub`); None (the
            default): no scrub. A local checkout does not re-hash what it maps, so this (or
            ``checkout(verify=True)``, or ``paramstore verify``) is what finds damage in place.
        shard_size_bytes: target size of one object (a tensor larger than this gets its own).
        prepare_buffers: after each commit, and after each checkout that fetched objects from
            peers, create and fault in the background the shared-memory buffers of the next
            version of the same layout, so the next snapshot copy or fetch writes at memory speed.
            Costs two spare model sizes of shared memory (two commits' worth, so that commits in
            quick succession each find faulted buffers).
        recycle_buffers: with ``retention`` (and ``prepare_buffers``), this process's background
            GC hands the objects of pruned versions back to the commit path instead of deleting
            them: they become the next commits' buffers, still mapped and faulted in, so commits
            copy at memory speed even back to back, and nothing is faulted or unmapped in between.
            A file is reused only once no other process has it open or mapped (a reader keeping
            tensors of an old version keeps its bytes; such a file is deleted as before). That is
            checked with a write lease (``F_SETLEASE``: the kernel's own count of open files,
            across PID namespaces) or, where leases are unavailable, by scanning ``/proc`` (a
            process it cannot read counts as a user): processes in another PID namespace sharing
            the tmpfs are invisible to that scan, so turn this off there if leases are
            unavailable. Published buffers stay mapped in this process until GC
            sweeps them (at most 4 commits' worth). Default True.
        pin_memory: page-lock commit slabs, once each for as long as they are mapped, when this
            process commits accelerator tensors (CUDA, Ascend), so device-to-host copies are
            asynchronous DMA (see :mod:`paramstore.pinning`); processes that only read never pin.
            False: never.
        device_latest: keep the latest version this process commits in a GPU's memory as well and
            share it with the node's other processes through CUDA IPC: their
            ``checkout(..., device=<that GPU>)`` of that version maps the buffers instead of
            copying (see :mod:`paramstore.device`). True: this process's current CUDA device; or a
            device such as ``"cuda:0"``; None/False (default): off. Costs one model's worth of
            device memory per version a reader still holds. Raises DeviceError without CUDA.
        device_bucket_bytes: size of one host-to-device copy of a device checkout (None: 64 MiB;
            two pinned bounce buffers of this size per device, two more for ``device_latest``).
        retention: a policy (for the shared-memory tier) or ``{"local": policy, "remote": policy}``;
            when given, prune and GC run in the background after each commit (and, for the remote,
            after each version persisted), off the training thread.
        remote: an fsspec URL (``s3://bucket/prefix``, ``file:///mnt/ckpt``) or a
            :class:`~paramstore.remote.Remote`. Every commit is then written through to it in the
            background (``handle.persisted``), and versions found only there are pulled on checkout.
        storage_options: options of the remote's filesystem (for S3: ``endpoint_url``, ``key``,
            ``secret``, ``profile``...; by default the usual AWS environment and config files).
        persist_retry_for: seconds, counted from its commit, that a version is retried through
            transient remote failures (then its ``handle.persisted`` fails with the last error).
        persist_backlog: with a remote, how many committed versions may wait for upload besides
            the one being pushed (an int >= 1, default 2). Each waiting version holds a local
            lease, so retention cannot prune it. When a commit would make the backlog longer
            (the remote is failing, or commits come faster than uploads), the oldest waiting
            version *that the remote retention policy would not keep* is skipped: its lease is
            released (local retention may prune it), a RuntimeWarning says so and why, and its
            ``handle.persisted`` fails with a RemoteError saying it was skipped because of the
            backlog; the rest are kept and retried, by one retry loop for the whole queue. A
            version the remote policy keeps (a ``KeepEvery`` milestone...) is never skipped, and
            local retention keeps it until the remote has it: the queue then grows past the
            backlog (said once) rather than stall the trainer. So shared memory holds for the
            upload at most ``persist_backlog + 1`` versions the remote policy would not keep,
            plus those it keeps not uploaded yet (see :mod:`paramstore.persist`); without a
            remote policy, the oldest is skipped: ``persist_backlog + 1`` in all. Opening a store with a remote also resumes, in the
            background, the uploads a previous run left unfinished: its newest
            ``persist_backlog`` local versions not persisted to that remote and not older than
            the remote's newest version.
        registry: None for the single-host LMDB registry in ``root/meta``, or ``redis://[:password@]
            host:port/db``: a registry shared by the hosts of a store (see ``paramstore.backends``).
        name: with a shared registry, the store's name there (required: every host of one store
            passes the same name; stores sharing a server differ by name).
        patches: make and use sparse patches between versions (see :mod:`paramstore.delta`). A
            committing process makes, after each commit and on a thread of its own, patch objects
            that rebuild the new version's objects from the version before it (only the elements
            that changed); a checkout that lacks objects of a version rebuilds them from patches
            against a version its host holds, moving the patches instead of whole objects, and
            checks every rebuilt object's digest (a bad patch falls back to the whole object).
            None (default): on with a shared registry or a remote (where bytes cross links), off
            for a single-host store; True or False to choose. Patches need the base version to
            still exist: keep at least two versions (retention) or hold a lease on the older one.

    Raises:
        NotAStoreError: ``root`` holds something other than a store, or is missing and
            ``create`` is false.
        RemoteError: the remote cannot be used (bad URL, missing bucket, access denied, unreachable).

    Example:
        >>> with ParamStore(root) as store:  # root: e.g. "/dev/shm/my-run"
        ...     store.commit(1, model).result().step
        ...     with store.checkout("latest") as snap:
        ...         snap.load_into(policy)
        1
        LoadResult(missing_keys=[], unexpected_keys=[])
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool | None = None,
        shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
        prepare_buffers: bool = True,
        recycle_buffers: bool = True,
        pin_memory: bool = True,
        retention: Policy | Mapping[str, Policy] | None = None,
        remote: str | Remote | None = None,
        storage_options: Mapping[str, Any] | None = None,
        persist_retry_for: float = 900.0,
        persist_backlog: int = DEFAULT_BACKLOG,
        registry: str | None = None,
        name: str | None = None,
        run_id: str | None = None,
        takeover: bool = False,
        shared_group: bool = False,
        scrub_rate: float | None = None,
        group_timeout: float = 600.0,
        patches: bool | None = None,
        device_latest: "bool | str | torch.device | None" = None,
        device_bucket_bytes: int | None = None,
    ) -> None:
        if isinstance(shard_size_bytes, bool) or not isinstance(shard_size_bytes, int) or shard_size_bytes <= 0:
            raise InvalidArgumentError(f"shard_size_bytes must be a positive int, got {shard_size_bytes!r}")
        if registry is not None and not name:
            raise InvalidArgumentError("a shared registry needs name=: the store's name, the same on every host")
        if storage_options is not None and (remote is None or isinstance(remote, Remote)):
            raise InvalidArgumentError("storage_options= configures the filesystem of remote=URL; pass them together "
                                       "(a Remote object carries its own options)")
        if isinstance(root, (str, os.PathLike)) and os.fspath(root) == "":
            raise InvalidArgumentError("root must be a directory path, got ''")
        if create is not None and not isinstance(create, bool):
            raise InvalidArgumentError(f"create must be True, False or None, got {create!r}")
        if patches is not None and not isinstance(patches, bool):
            raise InvalidArgumentError(f"patches must be True, False or None, got {patches!r}")
        self._patches = patches if patches is not None else (registry is not None or remote is not None)
        self._device_latest: torch.device | None = None
        if device_latest is not None and device_latest is not False:
            from .device import check_device_latest

            self._device_latest = check_device_latest(device_latest)
        if device_bucket_bytes is not None and (isinstance(device_bucket_bytes, bool) or not isinstance(
                device_bucket_bytes, int) or device_bucket_bytes <= 0):
            raise InvalidArgumentError(f"device_bucket_bytes must be a positive int, got {device_bucket_bytes!r}")
        self._device_bucket = device_bucket_bytes
        self._devices: DeviceCache | None = None  # made by the first device checkout
        self._exporter: LatestExporter | None = None
        self._patcher: Patcher | None = None
        self._patcher_lock = threading.Lock()
        self._run_id = new_run_id() if run_id is None else check_run_id(run_id)
        self._group_timeout = check_timeout(group_timeout)
        self._groups: dict[tuple[int, ...], Any] = {}  # ranks -> CommitGroup (sharded commits)
        self._broken_groups: list[Any] = []  # failed groups, destroyed at close
        self._streaming = 0  # streaming commits being staged on callers' threads (close() waits)
        self._scrub_rate = check_rate(scrub_rate)
        self._scrubber: Scrubber | None = None
        self._claimed = False  # this store claimed its root as writer (given up at close)
        self._takeover = bool(takeover)
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))  # "~/run" is the home's, not ./~
        _warn_if_not_shared_memory(self.root)  # before anything is opened
        self._open_args = {"registry": registry, "name": name or "", "shared_group": bool(shared_group)}
        self._create = create
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a streaming commit is queued
        self._attach_lock = threading.Lock()
        self._last_step: int | None = None  # highest step submitted by this process
        self._last_handle: CommitHandle | None = None
        self._committer: Committer | None = None
        self._shard_size = shard_size_bytes
        self._policies = tier_policies(retention)
        self._settled_metrics: set[str] = set()  # KeepBest metrics commit() no longer questions
        self._pin, self._recycle = pin_memory, recycle_buffers
        self._remote = remote if isinstance(remote, Remote) or remote is None else Remote(remote, storage_options)
        if "remote" in self._policies and self._remote is None:
            raise InvalidArgumentError("retention for the 'remote' tier needs remote=URL")
        self._persist_retry_for = persist_retry_for
        self._persist_backlog = check_backlog(persist_backlog)
        self._prepare = prepare_buffers
        self._peer: PeerServer | None = None
        self._transport: Transport | None = None
        self._transport_host = os.environ.get("PARAMSTORE_HOST", "127.0.0.1")
        # Set by _attach(), once the store exists (now, or when the first commit creates it).
        self._opened: StoreRoot | None = None
        self._pool: SlabPool | None = None
        self._maintainer: Maintainer | None = None
        self._persister: Persister | None = None
        self._fetcher: Fetcher | None = None
        self._recycle_ahead = 0
        self._closed = False
        self._owner = os.getpid()
        if create is not None or os.path.exists(os.path.join(self.root, MARKER)):
            self._attach(create=bool(create))  # create=False: the store must exist now
        else:
            check_creatable(self.root)  # a file or a directory of other files: refused at once
        # A script that commits and exits without close() must not lose the in-flight commit.
        ref = weakref.ref(self)
        self._atexit = lambda: (store := ref()) is not None and store.close()
        atexit.register(self._atexit)

    # -- opening -----------------------------------------------------------------------------
    def _attach(self, *, create: bool) -> StoreRoot:
        """Open the store (creating it if ``create``) and the parts that work on it; idempotent."""
        with self._attach_lock:
            if self._opened is not None:
                return self._opened
            self._check_open()
            root = open_root(self.root, create=create, **self._open_args)
            try:
                local_policy = self._policies.get("local")  # recycling needs GC in this process
                # Versions retention keeps (up to 3): published buffers stay mapped one commit longer (GC
                # sweeps a version once that many newer ones exist), and prepare() faults that many more.
                kept = min(maintenance.versions_kept(local_policy), 3)
                self._pool = SlabPool(root.tier.tmp_dir, pin=self._pin, keep_mapped=kept + 1,
                                      recycle=bool(self._recycle and self._prepare) and local_policy is not None)
                self._recycle_ahead = kept if self._pool.recycling else 0
                self._maintainer = Maintainer(root, self._policies, self._remote) if self._policies else None
                self._persister = None if self._remote is None else Persister(
                    root, self._remote, retry_for=self._persist_retry_for, backlog=self._persist_backlog, resume=False,
                    on_persisted=self._maintainer.poke_remote if self._maintainer is not None else None,
                    on_released=self._maintainer.poke if self._maintainer is not None else None,
                    gather=self._before_push, keeps=self._maintainer.awaiting_remote
                    if self._maintainer is not None and "remote" in self._policies else None)
                if self._scrub_rate is not None:
                    self._scrubber = Scrubber(root, self._scrub_rate)
                self._fetcher = Fetcher(root, self._pool, remote=self._remote, transport=self._get_transport,
                                        server=lambda: self._peer, prepare_buffers=self._prepare,
                                        patches=self._patches)
            except BaseException:
                root.close()
                raise
            self._opened = root
            return root

    @property
    def _root(self) -> StoreRoot:
        """The open store; a reader's first use opens it. A reader creates nothing, except that a
        root backed by a remote or a shared registry is a local cache of a store that exists
        elsewhere: it is made on first use (to pull or fetch into)."""
        if self._opened is not None:
            return self._opened
        cache = self._remote is not None or self._open_args["registry"] is not None
        return self._attach(create=cache and self._create is not False)

    def _await_root(self, timeout: float | None) -> float | None:
        """Wait until the store exists (a rollout started before its trainer); returns the time left.

        Raises WaitTimeoutError naming the path when ``timeout`` passes first.
        """
        if self._opened is not None or self._remote is not None or self._open_args["registry"] is not None:
            self._root  # noqa: B018 -- open it (a cache of a remote or shared store is made here)
            return timeout
        start, marker = time.monotonic(), os.path.join(self.root, MARKER)
        while not os.path.exists(marker):
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise WaitTimeoutError(f"no store exists at {self.root} (waited {timeout:.4g} s for one to appear; a "
                                       "reader never creates a store): check the path, and that the trainer started")
            self._check_open()
            time.sleep(_STORE_POLL_S if timeout is None else min(_STORE_POLL_S, max(0.0, timeout - waited)))
        self._root  # noqa: B018 -- open it
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))

    # -- commit ------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        tags: tuple[str, ...] | list[str] = (),
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        group: Any = None,
        assets: AssetsArg = None,
    ) -> CommitHandle:
        """Snapshot ``model``'s tensors as version ``step``; returns at once.

        The copy into shared memory runs on a background thread: ``handle.staged`` completes when
        it is taken (the trainer may then update its parameters; see :meth:`guard`), and
        ``handle.committed`` when the version is visible to every process.

        **Streaming.** ``model`` may also be an iterable of ``(name, tensor)`` pairs (a generator
        that gathers one tensor at a time, as verl's trainer hands weights over). Each tensor is
        copied into shared memory as it arrives and then dropped, so the caller never holds more
        than the tensor in hand; ``commit`` returns once the iterable is exhausted (``staged`` is
        then done) and publishing goes on in the background. Names tied by one storage are not
        detected in a stream (equal bytes are still stored once).

        **Sharded.** When the state dict holds DTensors, every rank of their mesh calls ``commit``
        with the same step and names, and each rank stores only its own blocks (``Shard(d)`` on
        any dims, uneven, several mesh dims; a replicated block once; plain tensors once, by the
        first rank): no rank gathers a tensor. The version is published once, when every rank's
        part is stored, and every rank's ``committed`` resolves with it (or fails with
        CommitGroupError, on every rank, if one rank failed or died). ``group=`` (a
        ``torch.distributed`` process group) makes plain tensors a commit of that group's ranks:
        written once, by its first rank, the others only iterate (see :mod:`paramstore.sharded`).

        **Assets.** A transformers ``PreTrainedModel`` keeps its ``config.json`` and
        ``generation_config.json`` with the version, and ``assets=`` attaches other files (a
        tokenizer): stored and moved like tensors, left out of the snapshot's tensors, written
        beside the shards by :meth:`export` so that ``from_pretrained`` loads the export as it is
        (see :mod:`paramstore.assets`).

        Args:
            step: trainer step, a non-negative int above every committed step.
            model: a ``torch.nn.Module`` (its ``state_dict()``), a mapping of names to tensors, or
                an iterable of ``(name, tensor)``.
            tags: names to point at this version (a tag that exists is moved).
            metrics: numbers to record (for retention by best metric, dashboards): ints, floats, NumPy
                scalars or one-element tensors (``loss.detach()``), stored as floats.
            metadata: any JSON-serializable mapping to record.
            dtype: store floating-point tensors in this dtype (cast while copying: a bf16 copy of
                fp32 master weights); other tensors keep theirs.
            group: the process group whose ranks commit this version together (inferred from the
                DTensors' meshes when None).
            assets: files kept with the version: a directory (every file at its top except
                weights, e.g. a model directory's configs and tokenizer files) or a mapping of
                file names to bytes or paths. The model's own config files (which describe the
                weights committed) win over files of the same name here.

        Returns:
            A :class:`CommitHandle`; ``handle.result()`` waits and returns the :class:`Version`.

        Raises:
            StepOrderError: ``step`` is not above the latest committed or in-flight step.
            InvalidTensorError, InvalidNameError, InvalidArgumentError: bad input; nothing is written.

        Example:
            >>> handle = store.commit(2, model, metrics={"reward": 0.7}, tags=["best"])
            >>> handle.staged.result()  # wait before optimizer.step(), or use store.guard(optimizer)
            >>> version = handle.result()  # visible to every process on the host
            >>> version.step, version.tags, version.metrics
            (2, ('best',), {'reward': 0.7})
            >>> weights = ((n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())
            >>> store.commit(3, weights).result().nbytes  # streamed, one tensor at a time
            116
        """
        self._check_open()
        from .tensors import Taker, check_cast, collect, commit_ranks, is_stream, model_items

        # First who commits together (no validation yet: a rank that fails any check below must
        # still tell the others, in the group's exchange for this step).
        stream = is_stream(model)
        if stream:
            pairs, ranks = self._stream_ranks(model, group)
        else:
            items = model_items(model)
            ranks = commit_ranks([v for _, v in items], group)
        commit_group = self._commit_group(ranks) if len(ranks) > 1 else None
        try:
            check_step(step)
            tags_t = tuple(check_tag(t) for t in ([tags] if isinstance(tags, str) else tags))
            metrics_d = check_metrics(metrics)
            metadata_d = check_metadata(metadata)
            if metrics_d and self._policies:  # a KeepBest metric that looks misspelt: refused here
                check_commit_metrics(self._policies.values(), metrics_d, lambda: () if self._opened is None
                                     else self._opened.registry.versions(), self._settled_metrics)
            cast = check_cast(dtype)
            files = {**read_assets(assets), **({} if stream else model_assets(model, cast))}
            if os.getpid() != self._owner:
                raise ParamStoreError("this store was opened in the parent process; open a new ParamStore "
                                      "after fork to commit from the child")
            if stream:
                taker = Taker(cast=cast, sharded=commit_group is not None, ranks=ranks,
                              writes_plain=commit_group is None or commit_group.is_lead, assets=files)
            else:
                collected = collect(items, dtype=cast, ranks=ranks, assets=files)
            root = self._attach(create=self._create is not False)
            with self._lock:
                self._check_open()  # under the lock: close() cannot slip in between
                if commit_group is None or commit_group.is_lead:  # the lead publishes: it is the writer
                    claim(root.registry, self._run_id, takeover=self._takeover, root=self.root)
                    self._claimed = True
                persist = self._persister is not None and (commit_group is None or commit_group.is_lead)
                if persist:
                    self._persister.resume()  # the writer finishes what its previous run left unpushed
                latest = root.registry.latest_step()
                floor = max(x for x in (latest, self._last_step, -1) if x is not None)
                if step <= floor:
                    raise StepOrderError(f"step {step} must be above the latest step {floor}")
                previous, self._last_step = self._last_step, step
                committer = self._get_committer()
                if stream:
                    self._streaming += 1  # close() waits for it: it is staged outside the lock
                else:
                    handle = committer.submit(step, collected, tags_t, metrics_d, metadata_d, persist=persist,
                                              group=commit_group)
        except BaseException as e:
            if commit_group is not None:  # the other ranks are committing this step: they must learn of it
                self._fail_in_group(commit_group, step, e)
            raise
        if stream:  # staged here, on the caller's thread, outside the lock
            try:
                handle = committer.submit_stream(step, pairs, taker, tags_t, metrics_d, metadata_d,
                                                 persist=persist, group=commit_group, ranks=ranks)
            finally:
                with self._lock:
                    self._streaming -= 1
                    self._idle.notify_all()
        self._last_handle = handle
        handle.committed.add_done_callback(lambda f: f.exception() and self._forget_step(step, previous))
        return handle

    def _fail_in_group(self, group: Any, step: int, error: BaseException) -> None:
        """This rank's commit of ``step`` failed before it was queued: take part in the group's
        exchange with the error (after this process's earlier commits), so every rank fails this
        step instead of waiting, and later steps stay in step."""
        last = self._last_handle
        if last is not None:
            wait([last.committed])
        try:
            group.fail(step, error)
        except ParamStoreError:
            pass  # the group is broken anyway: the others learn it from their own collectives

    def _stream_ranks(self, model: Iterable[Any], group: Any) -> tuple[Iterator[Any], tuple[int, ...]]:
        """The pairs of a streaming commit and the ranks committing it: ``group``'s, or those of
        the first tensor's mesh when it is a DTensor (a later DTensor must lie in them)."""
        from .tensors import check_pair, commit_ranks

        it = iter(model)
        first = next(it, None)
        if first is None:
            raise InvalidArgumentError("the commit's iterable yielded no tensors")
        ranks = commit_ranks([check_pair(first)[1]], group)
        return _prepend([first], it), ranks

    def _commit_group(self, ranks: tuple[int, ...]) -> Any:
        """The gloo group of ``ranks`` for sharded commits, made at their first one (collectively:
        every rank of ``ranks`` calls this at the same commit). A group that failed (a member died
        or timed out) is replaced at the next commit; the failed one is kept until close, so the
        new one gets a fresh name on every rank."""
        from .sharded import CommitGroup

        group = self._groups.get(ranks)
        if group is not None and group.broken:
            self._broken_groups.append(self._groups.pop(ranks))
            group = None
        if group is None:
            # the store as every rank names it: its shared name, or its root on this host
            identity = self._open_args["name"] if self._open_args["registry"] else os.path.realpath(self.root)
            group = self._groups[ranks] = CommitGroup(ranks, self._group_timeout, identity)
        return group

    def _forget_step(self, step: int, previous: int | None) -> None:
        # A failed commit does not use up its step: it may be retried.
        with self._lock:
            if self._last_step == step:
                self._last_step = previous

    def prepare(self, model: torch.nn.Module | Mapping[str, torch.Tensor], *, wait: bool = False,
                timeout: float | None = None) -> None:
        """Create and fault the shared-memory buffers ``model``'s first commits will use, in the background.

        Two commits' worth; with ``recycle_buffers`` and local retention, plus one for each
        version the policy keeps (up to 3; ``KeepLast(2)``: four in all), so that even commits
        back to back find faulted buffers until GC starts to hand old ones back: as much shared
        memory as the run holds in steady state anyway (kept versions + two spare).
        Optional: without it the first commits fault fresh pages while copying (several times
        slower); later commits are prepared automatically. Faulting takes ~0.3-0.8 s per GiB.

        Args:
            model: a module or state dict with the names, dtypes and shapes that will be committed.
            wait: block until the buffers are ready (else return at once).
            timeout: with ``wait``, the most seconds to wait.

        Raises:
            WaitTimeoutError: ``wait`` and not ready within ``timeout`` seconds.
            StorageFullError: ``wait`` and the filesystem had no room for the buffers (commits
                still work, faulting their buffers as they copy).
            InvalidArgumentError: ``timeout`` is not None nor a non-negative number.

        Example:
            >>> store.prepare(model, wait=True)  # at start-up, before the first commit
            >>> store.commit(2, model).result().step
            2
        """
        self._check_open()
        timeout = check_timeout(timeout)
        from .tensors import collect

        self._attach(create=self._create is not False)
        committer = self._get_committer()
        committer.prepare(collect(model, assets=model_assets(model)), ahead=self._recycle_ahead)
        if wait and not committer.wait_prepared(timeout):
            raise WaitTimeoutError(f"buffers not prepared within {timeout:.4g} s")

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait until the last commit's snapshot is taken.

        The wait is only as long as the copy still has to run; with no commit in flight it is free.
        For parameters on an accelerator the wait is on the device, not on this thread
        (:meth:`CommitHandle.fence`): the optimizer's kernels are queued after the commit's
        device-to-host copies, and the training thread is held only until those are queued.
        A failed commit is not re-raised here (see its handle or :meth:`flush`). Only parameters
        and buffers the optimizer step changes are protected: buffers updated during the forward
        pass (e.g. BatchNorm statistics) may change while a snapshot is being taken.
        Returns the hook handle (``.remove()`` undoes it).

        Example:
            >>> hook = store.guard(optimizer)
            >>> for step in (2, 3):
            ...     model(torch.ones(1, 4)).sum().backward()
            ...     optimizer.step()  # waits while the last commit's copy is still running
            ...     _ = store.commit(step, model)
            >>> store.flush().step
            3
            >>> hook.remove()
        """

        def _wait_for_staging(_opt: Any, _args: Any, _kwargs: Any) -> None:
            handle = self._last_handle
            if handle is not None:  # only wait: a failed commit reports through its handle
                handle.fence()

        return optimizer.register_step_pre_hook(_wait_for_staging)

    def wait_staged(self, *, timeout: float | None = None) -> None:
        """Block until the last commit of this process is staged (re-raises its error).

        Example:
            >>> _ = store.commit(2, model)
            >>> store.wait_staged(timeout=60)  # the copy is taken: model may change from here on
        """
        handle = self._last_handle
        if handle is not None:
            try:
                handle.staged.result(timeout)
            except FutureTimeout:
                raise WaitTimeoutError(f"commit of step {handle.step} not staged within {timeout:.4g} s") from None

    def flush(self, *, timeout: float | None = None) -> Version | None:
        """Wait until every commit of this process is visible (and, with patches, its patches are
        made); returns the last version.

        Example:
            >>> for step in (2, 3):
            ...     _ = store.commit(step, model)
            >>> store.flush(timeout=60).step
            3
        """
        handle = self._last_handle
        if handle is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        version = handle.result(timeout)  # raises WaitTimeoutError
        if self._patches and self._patcher_for().wait(
                version.step, None if deadline is None else max(0.0, deadline - time.monotonic())) is False:
            raise WaitTimeoutError(f"the patches of step {version.step} were not made within {timeout:.4g} s")
        return version

    def _before_push(self, step: int) -> None:
        """On the persister's thread, before a push: the objects other hosts hold come here (a shared
        registry), and the version's patches are made first (for up to a minute), so the remote can
        get them instead of whole objects."""
        if self._open_args["registry"] is not None:
            self._gather(step)
        if self._patches and self._patcher is not None:
            self._patcher.wait(step, PATCH_WAIT_S, submitted=False)

    def _exporter_for(self) -> LatestExporter:
        with self._patcher_lock:
            if self._exporter is None:
                from .device import LatestExporter

                assert self._device_latest is not None
                self._exporter = LatestExporter(self._root, self._device_latest, bucket_bytes=self._device_bucket)
            return self._exporter

    def _device_cache(self) -> DeviceCache:
        with self._patcher_lock:
            if self._devices is None:
                from .device import DeviceCache

                self._devices = DeviceCache(self._device_bucket)
            return self._devices

    def _patcher_for(self) -> Patcher:
        with self._patcher_lock:
            if self._patcher is None:
                self._patcher = Patcher(self._root, self._run_id)
            return self._patcher

    def _get_committer(self) -> Committer:
        if self._committer is None:
            from .commit import Committer

            self._committer = Committer(
                self._root.tier, self._root.registry, self._pool, self._shard_size,
                gc_lock=self._root.gc_lock, prepare_buffers=self._prepare, on_commit=self._after_commit,
                writer=self._run_id, reclaim=self._maintainer.reclaim if self._maintainer is not None else None,
            )
        return self._committer

    def _after_commit(self, version: Version, handle: CommitHandle) -> None:
        # On the publisher thread, before retention runs: the push's lease keeps the version
        # from being pruned locally until it is durable in the remote. Patches are asked for
        # first: the push waits for them.
        if self._patches:
            self._patcher_for().submit(version.step, version.writer)
        if self._device_latest is not None and version.writer == self._run_id:
            self._exporter_for().submit(version.step)
        if self._persister is not None and handle.persisted is not None:
            try:
                self._persister.submit(version.step, handle.persisted)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                handle.persisted.set_exception(e)
        if self._maintainer is not None:
            self._maintainer.poke()

    # -- read --------------------------------------------------------------------------------
    def checkout(
        self,
        version: VersionSpec = "latest",
        *,
        min_step: int | None = None,
        timeout: float | None = None,
        holder: str | None = None,
        verify: bool = False,
        device: "str | torch.device | None" = None,
        group: Any = None,
        src: int | None = None,
        bucket_bytes: int | None = None,
    ) -> Snapshot:
        """Map a version's tensors zero-copy and hold a lease on it until the snapshot is closed.

        **Integrity.** Objects fetched from peers or the remote are re-hashed before they are
        placed. Objects already on this host are *not* re-hashed by a plain checkout — by design,
        for speed: checkout reads no tensor byte. Each object's header and size are checked as it
        is mapped (a truncated object raises CorruptObjectError), but a flipped bit inside a
        tensor is served as it is. ``verify=True`` costs one hash pass over the version's bytes
        and catches it.

        Args:
            version: a step (int), ``"latest"``, or a tag. With a remote, a version (or tag) found
                only there is pulled first (verified); ``"latest"`` means the local latest, or the
                remote's when the local store is empty.
            min_step: instead of ``version``, the newest version whose step is ≥ ``min_step``;
                blocks until one exists (the staleness contract: a rollout at trainer step t with
                bound η asks for ``min_step=t - η``).
            timeout: with ``min_step``, seconds to wait before raising WaitTimeoutError.
            holder: a name for the lease (shown by ``leases()``); default ``pid <pid>``.
            verify: re-hash every byte mapped (the pages the tensors view) against the object
                digests and the manifest's tensor digests. A damaged object is moved to
                ``<root>/quarantine/`` (kept, and no longer used for dedup) before the error.
            device: where the snapshot's tensors live. None or ``"cpu"``: zero-copy views of
                shared memory. Any torch device (``"cuda:0"``, ``"npu:0"``): the version's objects
                in that device's memory, mapped from a colocated process that exports this version
                on this GPU (``ParamStore(device_latest=...)``, CUDA IPC: no copy), else copied from
                shared memory in buckets on a side stream; objects already on the device from an
                earlier checkout of this store are not copied again (``snap.device_source``,
                ``snap.device_bytes`` say which happened). Same lease and staleness rules.
            group: a ``torch.distributed`` process group: every member calls ``checkout`` with the
                same ``group``, ``src`` and ``version`` (or ``min_step``), and the version moves
                from the member ``src`` to the others over the group (NCCL, HCCL or gloo) in
                buckets, only the objects some member lacks, each checked against the manifest's
                digests before it is placed in that member's store (``snap.fetch.from_group``).
                An error on any member (a dead member, a digest mismatch, an unknown version on
                ``src``) raises BroadcastError on every member; nothing unverified is placed.
            src: with ``group``, the rank (in ``group``) of the member whose store holds the version
                (default 0).
            bucket_bytes: with ``group``, the size of one broadcast (default 64 MiB).

        Returns:
            A :class:`Snapshot`: a read-only ``Mapping[str, Tensor]`` with ``.version``, ``.step``,
            ``.digest``, ``.load_into(module)`` and ``.close()``.

        Raises:
            VersionNotFoundError / TagNotFoundError: no such version or tag.
            WaitTimeoutError: no version with step ≥ ``min_step`` within ``timeout``.
            CorruptObjectError: an object is truncated or malformed, or (``verify``) its bytes do not
                match; the message names the object and the version, and says to run
                ``paramstore verify --repair``.
            CorruptStoreError: the version's manifest in this host's registry cannot be parsed.
            DeviceError: ``device`` is not available in this process.
            BroadcastError: (``group``) the collective checkout failed on some member.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     print(snap.step, snap["0.weight"].shape, snap.fetch.moved)
            1 torch.Size([8, 4]) False
            >>> with store.checkout(min_step=1, timeout=60, holder="rollout-0") as snap:
            ...     snap.load_into(policy)  # the newest version with step >= 1 (waits for one)
            LoadResult(missing_keys=[], unexpected_keys=[])
            >>> with store.checkout(1, verify=True) as snap:  # one hash pass over its bytes
            ...     snap.step
            1
        """
        self._check_open()
        check_checkout_args(version, min_step, timeout)
        place = self._device_placer(device)
        if group is None and (src is not None or bucket_bytes is not None):
            raise InvalidArgumentError("src= and bucket_bytes= are for a collective checkout: pass group= too")
        if min_step is not None:
            timeout = self._await_root(timeout)
        collective = None if group is None else self._collective(group, 0 if src is None else src, version,
                                                                 min_step, timeout, bucket_bytes)
        snap = open_snapshot(self._root, self._fetcher, version, min_step=None if group is not None else min_step,
                             timeout=timeout, holder=holder or f"pid {os.getpid()}", resolve=self._resolve,
                             wait_for=lambda step, left: self.wait_for(step, timeout=left),
                             pull=self._pull_if_remote, verify=verify, collective=collective, place=place)
        return snap

    def _device_placer(self, device: Any) -> "Callable[[Snapshot], Snapshot] | None":
        """What turns a checked-out snapshot into one on ``device`` (None: stay a CPU snapshot)."""
        if device is None:
            return None
        from . import accel

        dev = accel.as_device(device)
        if dev.type == "cpu":
            return None
        return lambda snap: self._device_cache().place(snap, dev, self._root)

    def _collective(self, group: Any, src: int, version: VersionSpec, min_step: int | None,
                    timeout: float | None, bucket_bytes: int | None) -> Callable[[], FetchReport]:
        """The broadcast of a collective checkout (run by ``open_snapshot`` before it leases)."""
        from .collective import broadcast_version

        if isinstance(src, bool) or not isinstance(src, int) or src < 0:
            raise InvalidArgumentError(f"src must be a rank (an int >= 0) in the group, got {src!r}")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                         or bucket_bytes <= 0):
            raise InvalidArgumentError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")

        def resolve(v: VersionSpec) -> int:  # called on src only
            return self.wait_for(min_step, timeout=timeout).step if min_step is not None else self._resolve(v)

        extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        return lambda: broadcast_version(self._root, self._pool, TorchCollective(group), src, version,
                                         resolve=resolve, **extra)

    def versions(self) -> list[Version]:
        """Every version, in increasing step order.

        Example:
            >>> _ = store.commit(2, model, tags=["best"]).result()
            >>> [(v.step, v.tags) for v in store.versions()]
            [(1, ()), (2, ('best',))]
        """
        self._check_open()
        return list(self._root.registry.versions())

    def latest(self) -> Version | None:
        """The newest version, or None if the store is empty, or does not exist yet (a trainer's
        resume logic before its first commit creates it).

        Example:
            >>> v = store.latest()
            >>> v.step, v.num_tensors, v.nbytes
            (1, 4, 232)
        """
        self._check_open()
        if self._not_created():
            return None
        step = self._root.registry.latest_step()
        return None if step is None else self._root.registry.get_version(step)

    def get(self, version: VersionSpec) -> Version:
        """The :class:`Version` named by a step, ``"latest"`` or a tag.

        Raises:
            VersionNotFoundError / TagNotFoundError: no such version or tag.

        Example:
            >>> _ = store.tag(1, "release")
            >>> store.get("release") == store.get(1) == store.get("latest")
            True
            >>> store.get(7)
            Traceback (most recent call last):
            ...
            paramstore.errors.VersionNotFoundError: ...
        """
        self._check_open()
        return self._root.registry.get_version(self._resolve(version))

    def _not_created(self) -> bool:
        """No store exists at the root yet, and this handle's first commit would create it: the
        trainer's own calls before that commit (``latest``, ``leases``, ``wait_for_readers``) answer
        "none" instead of a reader's NotAStoreError."""
        return (self._opened is None and self._create is None and self._remote is None
                and self._open_args["registry"] is None and not os.path.exists(os.path.join(self.root, MARKER)))

    def _resolve(self, version: VersionSpec) -> int:
        try:
            return self._root.resolve(version)
        except VersionNotFoundError:  # an empty store, or an unknown tag: ask the remote
            if self._remote is None:
                raise
            return self._remote.resolve(version)

    # -- peers -------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", *, transport: Transport | None = None) -> PeerServer:
        """Serve this host's objects to other hosts (one server per host is enough).

        Registers the host's shared-memory objects with a Mooncake transfer engine listening on
        ``host`` (an address other hosts reach; the engine has no authentication: use a private
        network) and announces them in the registry, which must be shared by the hosts
        (``registry="redis://..."``). Checkouts in this process then also announce what they fetch.

        Example (not run as a doctest: it starts a Mooncake transfer engine listening on ``host``,
        which needs ``paramstore[mooncake]`` and Debian's ``libibverbs1``):
            >>> store = paramstore.ParamStore(root, registry=redis_url, name="run-42")  # doctest: +SKIP
            >>> server = store.serve("10.0.0.7")  # doctest: +SKIP
        """
        self._check_open()
        if self._peer is None:
            if transport is not None:
                self._transport = transport
            self._transport_host = host
            self._peer = PeerServer(self._root, self._get_transport())
        return self._peer

    def _get_transport(self) -> Transport:
        """This process's transport, made on first use by the entry point ``$PARAMSTORE_TRANSPORT``
        names (default ``mooncake``; see :func:`paramstore.backends.transports.open_transport`)."""
        if self._transport is None:
            self._transport = open_transport(None, self._transport_host)
        return self._transport

    def _pull_if_remote(self, step: int) -> TransferReport | None:
        if self._remote is None:
            return None
        try:
            return self._remote.pull(self._root, step)
        except VersionNotFoundError:
            return None

    # -- remote ------------------------------------------------------------------------------
    @property
    def remote(self) -> Remote | None:
        """The remote tier, if configured.

        Example:
            >>> store.remote is None  # opened without remote=
            True
        """
        return self._remote

    def _need_remote(self) -> Remote:
        self._check_open()
        if self._remote is None:
            raise InvalidArgumentError("this store has no remote; open it with ParamStore(root, remote=URL)")
        return self._remote

    def push(self, version: VersionSpec = "latest", *, show_progress: bool | None = None) -> TransferReport:
        """Upload a local version to the remote now (blocking); a no-op if it is already there.

        Raises RemoteError, VersionNotFoundError.

        Example:
            >>> with paramstore.ParamStore(root) as store:  # committed before there was a remote
            ...     store.commit(1, model).result().step
            1
            >>> store = paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options)
            >>> report = store.push(1)  # only objects the remote lacks are uploaded
            >>> report.step, report.objects, report.skipped
            (1, 1, 0)
            >>> store.push(1).objects  # already there
            0
            >>> store.close()
        """
        remote, step = self._need_remote(), self._root.resolve(version)
        if self._open_args["registry"] is not None:
            self._gather(step)
        return remote.push(self._root, step, show_progress=show_progress)

    def _gather(self, step: int) -> None:
        """Make every object of version ``step`` present on this host (from peers, else the
        remote), under a lease: before a push of a version whose blocks were committed on
        several hosts."""
        root = self._root
        with root.leased([step], holder="paramstore gather"):
            self._fetcher.fetch(step, root.registry.get_manifest(step))

    def pull(self, version: VersionSpec = "latest", *, show_progress: bool | None = None) -> TransferReport:
        """Download a remote version into this store (verified), without checking it out.

        Objects already here are not downloaded. Raises RemoteError, VersionNotFoundError,
        CorruptObjectError (a remote object whose bytes do not match its digest; nothing is placed).

        Example:
            >>> with paramstore.ParamStore(root + "/trainer", remote=bucket_url,
            ...                            storage_options=storage_options) as trainer:
            ...     trainer.commit(1, model).persisted.result().step
            1
            >>> store = paramstore.ParamStore(root + "/other-host", remote=bucket_url,
            ...                               storage_options=storage_options)
            >>> report = store.pull(1)
            >>> report.objects, [v.step for v in store.versions()]
            (1, [1])
            >>> store.close()
        """
        remote = self._need_remote()
        return remote.pull(self._root, remote.resolve(version), show_progress=show_progress)

    def remote_versions(self) -> list[Version]:
        """Every complete version in the remote, in increasing step order.

        Raises RemoteError when no paramstore remote lives at the URL yet (a read never creates
        one: the first push or commit does; a mistyped URL is not an empty remote), or its bucket
        does not exist.

        Example:
            >>> store = paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options)
            >>> store.remote_versions()  # nothing was pushed to this URL yet
            Traceback (most recent call last):
            ...
            paramstore.errors.RemoteError: no paramstore remote at ...
            >>> store.commit(1, model, metrics={"reward": 0.5}).persisted.result().step
            1
            >>> [(v.step, v.metrics) for v in store.remote_versions()]
            [(1, {'reward': 0.5})]
            >>> store.close()
        """
        return self._need_remote().versions()

    def persisted(self) -> dict[int, str]:
        """Local versions known to be durable in a remote: step -> remote URL.

        Example:
            >>> store = paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options)
            >>> _ = store.commit(1, model).persisted.result()
            >>> store.persisted() == {1: bucket_url}
            True
            >>> store.close()
        """
        self._check_open()
        return self._root.registry.persisted()

    def wait_persisted(self, *, timeout: float | None = None) -> None:
        """Block until every version committed so far is pushed (or failed). Raises WaitTimeoutError.

        Example:
            >>> store = paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options)
            >>> for step in (1, 2):
            ...     _ = store.commit(step, model)
            >>> store.wait_persisted(timeout=60)
            >>> sorted(store.persisted())
            [1, 2]
            >>> store.close()
        """
        self.flush(timeout=timeout)
        if self._persister is not None and not self._persister.wait(timeout):
            n = self._persister.pending
            raise WaitTimeoutError(f"{n} version{'' if n == 1 else 's'} not persisted within {timeout:.4g} s")

    # -- wait --------------------------------------------------------------------------------
    def subscribe(self, *, min_step: int | None = None,
                  timeout: float | None = None) -> Iterator[Version]:
        """Yield every new version in step order as it becomes visible, from any process.

        Sleeps between versions (inotify on the registry's events file): no busy spinning.

        Args:
            min_step: yield versions with step ≥ ``min_step`` (inclusive, like
                ``checkout(min_step=)`` and ``wait_for``), those already visible first; default:
                only versions committed after the call. ``min_step=0`` yields every version.
            timeout: end the iteration when no new version arrives for this many seconds.

        Example:
            >>> _ = store.commit(2, model).result()
            >>> for v in store.subscribe(min_step=1, timeout=0.1):  # a rollout loop (ends after 0.1 s idle)
            ...     with store.checkout(v.step) as snap:
            ...         _ = snap.load_into(policy)
            ...     print(v.step)
            1
            2
        """
        self._check_open()
        if min_step is not None:
            check_bound(min_step, "min_step")
        check_timeout(timeout)
        existed = self._opened is not None or os.path.exists(os.path.join(self.root, MARKER))
        left = self._await_root(timeout)  # WaitTimeoutError naming the path if no store appears
        reg = self._root.registry
        watch = reg.watch()  # armed now: nothing committed after this call is missed
        if min_step is None:
            latest = reg.latest_step() if existed else None  # a store made since the call: all of it is new
            last = -1 if latest is None else latest
        else:
            last = max(min_step - 1, -1)
        gen = self._follow(watch, last, left)
        weakref.finalize(gen, watch.close)  # a subscription dropped before its first next() frees its watch
        return gen

    def _follow(self, watch: Any, last: int, timeout: float | None) -> Iterator[Version]:
        reg = self._root.registry
        with watch:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                new = list(reg.versions(after=last))
                for v in new:
                    last = v.step
                    yield v
                if new and timeout is not None:
                    deadline = time.monotonic() + timeout  # the timeout counts idle time
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                watch.wait(left)  # woken by any change (leases too): re-read and loop
                self._check_open()

    def wait_for(self, step: int, *, timeout: float | None = None) -> Version:
        """Block until a version with step ≥ ``step`` is visible; return the newest one.

        Raises:
            WaitTimeoutError: none appeared within ``timeout`` seconds.

        Example:
            >>> import threading
            >>> threading.Timer(0.05, store.commit, (2, model)).start()  # a trainer, elsewhere
            >>> store.wait_for(2, timeout=60).step
            2
            >>> store.wait_for(3, timeout=0.1)
            Traceback (most recent call last):
            ...
            paramstore.errors.WaitTimeoutError: no version with step >= 3 within 0.1 s (latest: 2)
        """
        self._check_open()
        check_timeout(timeout)
        check_bound(step, "step")
        timeout_left = self._await_root(timeout)
        reg = self._root.registry
        deadline = None if timeout_left is None else time.monotonic() + timeout_left
        with reg.watch() as watch:
            while True:
                latest = reg.latest_step()
                if latest is not None and latest >= step:
                    return reg.get_version(latest)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeoutError(f"no version with step >= {step} within {timeout:.4g} s (latest: {latest})")
                watch.wait(left)

    # -- leases and staleness ------------------------------------------------------------------
    def leases(self) -> list[Lease]:
        """Live leases: which versions readers hold, by whom, since when (``Lease.acquired_at``).

        Example:
            >>> with store.checkout(1, holder="rollout-0"):
            ...     [(lease.step, lease.holder) for lease in store.leases()]
            [(1, 'rollout-0')]
            >>> store.leases()  # released on close
            []
        """
        self._check_open()
        return [] if self._not_created() else self._root.registry.leases()

    def oldest_leased_step(self) -> int | None:
        """The oldest step any live reader holds (how far behind the slowest reader is), or None.

        Example:
            >>> store.oldest_leased_step() is None
            True
            >>> _ = store.commit(2, model).result()
            >>> slow, fast = store.checkout(1), store.checkout(2)
            >>> store.oldest_leased_step()
            1
            >>> slow.close(); fast.close()
        """
        steps = [lease.step for lease in self.leases()]
        return min(steps) if steps else None

    def wait_for_readers(self, min_step: int, *, timeout: float | None = None) -> None:
        """Block until no live lease is on a version older than ``min_step``.

        With ``checkout(min_step=...)`` on the rollout side this makes t − v ≤ η a store
        guarantee: before training step t the trainer calls ``wait_for_readers(t - η)``.
        A reader that dies stops counting at once (its leases die with it). Before the trainer's
        first commit has created the store it returns at once: no reader can hold anything yet.

        Raises:
            WaitTimeoutError: readers still hold older versions after ``timeout`` seconds.

        Example:
            >>> snap = store.checkout(1)  # a rollout still on step 1
            >>> _ = store.commit(2, model).result()
            >>> store.wait_for_readers(2, timeout=0.1)
            Traceback (most recent call last):
            ...
            paramstore.errors.WaitTimeoutError: 1 reader still holds a version older than step 2 after 0.1 s ...
            >>> snap.close()
            >>> store.wait_for_readers(2, timeout=60)  # returns at once: nobody holds step 1 now
        """
        self._check_open()
        check_timeout(timeout)
        check_bound(min_step, "min_step")
        if self._not_created():
            return
        reg = self._root.registry
        deadline = None if timeout is None else time.monotonic() + timeout
        with reg.watch("leases") as watch:
            while True:
                old = [lease for lease in reg.leases() if lease.step < min_step]
                if not old:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeoutError(
                        f"{'1 reader still holds a version' if len(old) == 1 else f'{len(old)} readers still hold versions'}"
                        f" older than step {min_step} after {timeout:g} s "
                        f"(oldest: step {min(lease.step for lease in old)}, held by {old[0].holder})")
                # releases wake us; deaths are noticed by polling
                watch.wait(_DEATH_POLL_S if left is None else min(left, _DEATH_POLL_S))

    # -- inspection ----------------------------------------------------------------------------
    def manifest(self, version: VersionSpec = "latest") -> Manifest:
        """The :class:`~paramstore.Manifest` of a version: where each tensor lies, its dtype, shape, digest.

        Example:
            >>> man = store.manifest("latest")
            >>> man.names() == sorted(model.state_dict())
            True
            >>> e = man.entry("0.weight")
            >>> e.dtype, e.shape, e.nbytes
            ('F32', (8, 4), 128)
        """
        self._check_open()
        return self._root.registry.get_manifest(self._resolve(version))

    def verify(self, version: VersionSpec | None = None, *, repair: bool = False,
               show_progress: bool | None = False) -> dict[str, Any]:
        """Re-hash the objects of one version (or of every version) and check every manifest entry.

        Returns a report: ``ok``, ``corrupt`` (object -> why), ``missing`` objects,
        ``unreadable_manifests``, ``damaged_versions``, counts, and ``advice`` (what to run next,
        empty when all is well); for a whole-store check also ``orphans`` (objects no version
        references) and ``leftovers`` (temporary files). Each version checked is leased meanwhile.

        ``repair=True`` then acts on what it found: damaged objects are moved to
        ``<root>/quarantine/`` (kept for forensics, dropped from the dedup index so that the next
        commit of the same weights writes fresh bytes), and good copies are fetched from peers or
        this store's remote (re-hashed before they are placed). The report adds ``quarantined``
        (object -> path), ``restored`` (objects fetched) and ``unrepaired`` (step -> why), and
        ``ok``/``advice`` then describe the store after the repair: remove what stays damaged
        with :meth:`remove`.

        Example:
            >>> report = store.verify()
            >>> report["ok"], report["versions_checked"], report["corrupt"], report["missing"], report["advice"]
            (True, 1, {}, [], '')
            >>> store.verify(1)["ok"]
            True
            >>> r = store.verify(repair=True)  # nothing to repair
            >>> r["ok"], r["quarantined"], r["restored"], r["unrepaired"]
            (True, {}, [], {})
        """
        self._check_open()
        steps = None if version is None else [self._root.resolve(version)]
        report = ops.verify(self._root, steps, show_progress=show_progress)
        return ops.repair(self._root, self._fetcher, report) if repair else report

    def remove(self, version: VersionSpec) -> Version:
        """Remove a version from this store, for good (``paramstore rm``): for one that
        :meth:`verify` with ``repair=True`` could not repair.

        Its manifest, tags and persisted mark go at once; its objects at the next :meth:`gc`
        (those no other version references). A remote keeps its copy. Refused
        (InvalidArgumentError) while a reader holds a lease on it — the message names the
        holders — and for the latest version, which the store always keeps (commit a newer one
        first). Returns the removed version's record.

        Raises:
            VersionNotFoundError / TagNotFoundError: no such version or tag.
            InvalidArgumentError: the version is leased, or is the latest.

        Example:
            >>> _ = store.commit(2, model).result()
            >>> store.remove(1).step, [v.step for v in store.versions()]
            (1, [2])
            >>> with store.checkout(2) as snap:
            ...     store.remove(2)
            Traceback (most recent call last):
            ...
            paramstore.errors.InvalidArgumentError: version 2 is in use: leased by 'pid ...' ...
        """
        self._check_open()
        return ops.remove_version(self._root, self._root.resolve(version))

    def patches(self, version: VersionSpec | None = None) -> dict[tuple[int, int], dict[str, int]]:
        """The patches recorded (of ``version`` as their target, when given): ``(base, target) ->
        {"objects": patch objects, "bytes": their size, "changed": objects of the target they
        rebuild}`` (see :mod:`paramstore.delta` and ``ParamStore(patches=)``).

        Example:
            >>> store.patches()  # a single-host store makes none unless patches=True
            {}
        """
        self._check_open()
        return patch_summary(self._root, None if version is None else self._root.resolve(version))

    def du(self) -> dict[str, Any]:
        """Logical bytes (every version's tensors) against bytes stored (of which ``patch_bytes``
        in ``patch_objects`` patch objects), and the dedup ratio.

        Example:
            >>> _ = store.commit(2, model).result()  # unchanged tensors: stored once
            >>> report = store.du()
            >>> report["versions"], report["objects"], report["logical_bytes"]
            (2, 1, 464)
        """
        self._check_open()
        return ops.du(self._root)

    def diff(self, a: VersionSpec, b: VersionSpec) -> dict[str, Any]:
        """Tensors added, removed and changed from version ``a`` to ``b``, with bytes and max \\|Δ\\|.

        Example:
            >>> with torch.no_grad():
            ...     _ = model[2].bias.add_(1.0)
            >>> _ = store.commit(2, model).result()
            >>> d = store.diff(1, 2)
            >>> [(c["name"], round(c["max_abs_diff"], 3)) for c in d["changed"]], d["unchanged"], d["added"]
            ([('2.bias', 1.0)], 3, [])
        """
        self._check_open()
        return ops.diff(self._root, self._root.resolve(a), self._root.resolve(b))

    def export(self, version: VersionSpec, directory: str | os.PathLike[str], *,
               shard_size_bytes: int | None = None, show_progress: bool | None = False,
               assets_from: str | os.PathLike[str] | None = None, weights_only: bool = False) -> dict[str, Any]:
        """Write a version as a Hugging Face model directory: safetensors shards,
        ``model.safetensors.index.json`` and the version's assets (``config.json``, tokenizer
        files), which ``from_pretrained(directory)`` and ``vllm.LLM(model=directory)`` load as it is.

        ``directory`` must be new or empty. An export that would not load (no ``config.json``
        naming a ``model_type``: a version committed from a plain module or state dict) is refused
        before anything is written: pass ``assets_from=`` a model directory holding its config
        (and tokenizer), or ``weights_only=True`` for the shards and index alone (see
        :func:`paramstore.export.export`). Returns ``{"step", "directory", "files", ...}``.

        Example:
            >>> out = store.export("latest", root + "/hf", weights_only=True)  # a plain module: no config
            >>> out["files"]
            ['model-00001-of-00001.safetensors', 'model.safetensors.index.json']
            >>> out["step"], out["total_size"]
            (1, 232)
            >>> import transformers
            >>> gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
            >>> _ = store.commit(2, gpt2, assets={"chat_template.jinja": b"{{ messages }}"}).result()
            >>> store.export(2, root + "/gpt2")["files"][1:]
            ['chat_template.jinja', 'config.json', 'generation_config.json', 'model.safetensors.index.json']
            >>> type(transformers.AutoModelForCausalLM.from_pretrained(root + "/gpt2")).__name__
            'GPT2LMHeadModel'
        """
        self._check_open()
        return export(self._root, self._root.resolve(version), os.fspath(directory),
                      shard_size_bytes=DEFAULT_EXPORT_SHARD_BYTES if shard_size_bytes is None else shard_size_bytes,
                      show_progress=show_progress, assets_from=assets_from, weights_only=weights_only)

    # -- retention ---------------------------------------------------------------------------
    def prune(self, policy: Policy, *, dry_run: bool = False, tier: str = "local") -> PruneReport:
        """Remove the versions ``policy`` does not keep; the latest and leased versions are always kept.

        Objects are reclaimed by :meth:`gc`. Returns a report with the reasons for every kept version.
        ``tier="remote"`` prunes the remote instead (its latest version is always kept).

        Example:
            >>> from paramstore.retention import AnyOf, KeepLast, KeepBest
            >>> for step, reward in [(2, 0.9), (3, 0.1), (4, 0.2), (5, 0.3)]:
            ...     _ = store.commit(step, model, metrics={"reward": reward})
            >>> _ = store.flush()
            >>> rule = AnyOf(KeepLast(2), KeepBest(1, "reward"))
            >>> store.prune(rule, dry_run=True).removed  # what it would remove
            [1, 3]
            >>> report = store.prune(rule)
            >>> report.kept
            {2: ['best 1 by reward (max)'], 4: ['one of the last 2'], 5: ['one of the last 2', 'latest']}
            >>> report.removed
            [1, 3]
        """
        self._check_open()
        if _tier(tier) == "remote":
            return maintenance.prune_remote(self._need_remote(), policy, dry_run=dry_run)
        return maintenance.prune(self._root, policy, dry_run=dry_run)

    def gc(self, *, dry_run: bool = False, tier: str = "local", grace: float | None = None) -> GcReport:
        """Delete objects and temporary files that no surviving version (or live commit) references.

        ``tier="remote"``: objects no remote version references, once no push or pull is running
        (see :mod:`paramstore.remote`), sparing objects younger than ``grace`` seconds (default: the
        remote's lock TTL).

        Example:
            >>> from paramstore.retention import KeepLast
            >>> with torch.no_grad():
            ...     for p in model.parameters():
            ...         _ = p.add_(1.0)  # every tensor changes: step 2 shares no object with step 1
            >>> _ = store.commit(2, model).result()
            >>> store.prune(KeepLast(1)).removed
            [1]
            >>> store.gc(dry_run=True).objects == store.gc().objects  # step 1's object, now unreferenced
            True
            >>> store.gc().objects  # nothing left to delete
            []
        """
        self._check_open()
        if _tier(tier) == "remote":
            return maintenance.gc_remote(self._need_remote(), dry_run=dry_run,
                                         grace=check_timeout(grace, "grace"))
        if grace is not None:
            raise InvalidArgumentError("grace= applies to the remote tier only (gc(tier='remote', grace=...)); the "
                                       "local GC never deletes what a version or a live commit references")
        return maintenance.gc(self._root, dry_run=dry_run)

    # -- tags --------------------------------------------------------------------------------
    def tag(self, version: VersionSpec, name: str) -> Version:
        """Point tag ``name`` at ``version`` (moving it if it exists); returns that version.

        Example:
            >>> store.tag("latest", "release").tags
            ('release',)
            >>> _ = store.commit(2, model).result()
            >>> store.tag(2, "release").step  # moved
            2
            >>> store.get("release").step, store.get(1).tags
            (2, ())
        """
        self._check_open()
        check_tag(name)
        step = self._resolve(version)
        self._root.registry.set_tag(name, step)
        return self._root.registry.get_version(step)

    def untag(self, name: str) -> int:
        """Remove tag ``name``; returns the step it pointed at. Raises TagNotFoundError if it does not exist.

        Example:
            >>> _ = store.tag(1, "candidate")
            >>> store.untag("candidate")
            1
            >>> store.get(1).tags
            ()
            >>> store.untag("candidate")
            Traceback (most recent call last):
            ...
            paramstore.errors.TagNotFoundError: ...
        """
        self._check_open()
        return self._root.registry.delete_tag(check_tag(name))

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight commits (and, with a remote, their pushes), release buffers and close
        the registry. Idempotent. (``with ParamStore(...) as store:`` closes it on exit.)

        Example:
            >>> handle = store.commit(2, model)
            >>> store.close()  # waits for step 2
            >>> handle.done()
            True
            >>> store.close()  # again: nothing to do
            >>> store.latest()
            Traceback (most recent call last):
            ...
            paramstore.errors.StoreClosedError: store ... is closed
        """
        with self._attach_lock:  # a reader thread inside _attach() finishes first (or sees it closed)
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._atexit)
        with self._lock:  # a streaming commit being staged on another thread is queued first
            while self._streaming:
                self._idle.wait()
        if self._opened is None:
            for group in self._groups.values():
                group.destroy()
            return
        if os.getpid() != self._owner:
            # A forked child: the commit threads, the pool's files and the retention thread
            # belong to the parent. Only this process's registry handle is released.
            self._opened.close()
            return
        if self._scrubber is not None:
            self._scrubber.close()
        if self._committer is not None:
            self._committer.close()
        if self._patcher is not None:
            self._patcher.close()
        if self._exporter is not None:
            self._exporter.close()
        if self._devices is not None:
            self._devices.close()
        if self._claimed:
            try:
                release(self._opened.registry, self._run_id)  # the next trainer starts without a warning
            except ParamStoreError:
                pass  # the registry is gone or damaged: nothing to give up
        if self._persister is not None:
            self._persister.close()  # every committed version is pushed (or has failed) first
        if self._maintainer is not None:
            self._maintainer.close()
        if self._peer is not None:
            self._peer.close()
        if self._transport is not None:
            self._transport.close()
        if self._pool is not None:
            self._pool.close()
        for group in [*self._groups.values(), *self._broken_groups]:
            group.destroy()
        self._opened.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.root} is closed")

    def __enter__(self) -> "ParamStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ParamStore({self.root!r})"


def _prepend(box: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    """The item in ``box``, then ``rest``; the item is let go of once handed over (``itertools.chain``
    would keep it until the end: the first tensor of a streaming commit alive for the whole commit)."""
    yield box.pop()
    yield from rest


def _warn_if_not_shared_memory(path: str) -> None:
    """Warn once per root that is not on a memory filesystem (tmpfs): it works, but objects live in
    a disk's page cache, commits write to disk, and checkouts are not zero-copy views of shared memory."""
    fstype = _fstype(path)
    if fstype is None or fstype in _MEMORY_FILESYSTEMS or path in _warned_roots:
        return
    _warned_roots.add(path)
    warnings.warn(
        f"store root {path} is on a {fstype} filesystem, not tmpfs: commits and checkouts work, but objects "
        "are written to that filesystem and checkouts map its page cache instead of shared memory (slower, "
        "and evictable). Put the root on /dev/shm (or another tmpfs) for zero-copy shared memory.",
        ParamStoreWarning, stacklevel=3)


_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}
_warned_roots: set[str] = set()


def _fstype(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mounts), or None if unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def _tier(name: str) -> str:
    if name not in maintenance.TIERS:
        raise InvalidArgumentError(f"unknown tier {name!r}; known tiers: {', '.join(maintenance.TIERS)}")
    return name
