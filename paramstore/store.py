"""``ParamStore``: the public face of a store. It only delegates.

Where a byte goes: on commit, :mod:`paramstore.write_side` then :mod:`paramstore.commit`; on
checkout, :mod:`paramstore.read_side`, :mod:`paramstore.checkout` and :mod:`paramstore.snapshot`;
on disk, :mod:`paramstore.format` and ``paramstore.backends``. Options: :mod:`paramstore.options`.
"""

from __future__ import annotations

import atexit
import os
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from . import maintenance, ops
from .assets import AssetsArg
from .delta import patch_summary
from .following import FollowedCommit
from .errors import InvalidArgumentError
from .export import DEFAULT_EXPORT_SHARD_BYTES, export
from .manifest import Manifest, Version
from .opening import Opening
from .options import StoreOptions
from .read_side import ReadSide
from .remote import Remote
from .reports import GcReport, PruneReport, TransferReport
from .retention import Policy
from .root import StoreRoot, VersionSpec
from .staging import SlabPool
from .validate import check_tag, check_timeout
from .write_side import WriteSide

from paramstore.backends.registries.base import Lease
from paramstore.backends.transports.base import Transport

if TYPE_CHECKING:  # torch is imported on first use: the CLI's metadata commands start fast
    import torch

    from .commit import CommitHandle
    from .peer import PeerServer
    from .recipes import Recipe
    from .snapshot import Snapshot

__all__ = ["ParamStore"]


class ParamStore:
    """A versioned parameter store rooted at a directory (put it on ``/dev/shm``).

    Any number of processes on the host may open the same root at once. A missing store is
    created by the first :meth:`commit` (or :meth:`prepare`), never by a reader: reads of a store
    that does not exist raise NotAStoreError, and waits (``wait_for``, ``subscribe``,
    ``checkout(min_step=)``) wait for it to appear. With ``remote=`` or ``registry=`` the root is
    a local cache of a store that lives elsewhere, made on first use to pull or fetch into.

    Args:
        root: the store directory.
        options: a :class:`~paramstore.options.StoreOptions`, or a plain mapping of its fields (a
            framework's config passed through); see ``docs/options.md`` for the table.
        **overrides: options as keyword arguments (``retention=KeepLast(2)``), applied over ``options``.

    Raises:
        NotAStoreError: ``root`` holds something other than a store, or is missing and
            ``create`` is false.
        InvalidArgumentError: an unknown or bad option (nothing is opened).
        RemoteError: the remote cannot be used (bad URL, missing bucket, access denied, unreachable).

    Example:
        >>> with ParamStore(root) as store:  # root: e.g. "/dev/shm/my-run"
        ...     store.commit(1, model).result().step
        ...     with store.checkout("latest") as snap:
        ...         snap.load_into(policy)
        1
        LoadResult(missing_keys=[], unexpected_keys=[])
    """

    def __init__(self, root: str | os.PathLike[str], options: StoreOptions | Mapping[str, Any] | None = None,
                 **overrides: Any) -> None:
        if not isinstance(root, (str, os.PathLike)) or os.fspath(root) == "":
            raise InvalidArgumentError(f"root must be a directory path, got {root!r}")
        self.options = StoreOptions.build(options, overrides)
        remote = self.options.remote
        if remote is not None and not isinstance(remote, Remote):
            remote = Remote(remote, self.options.storage_options)
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))  # "~/run" is the home's, not ./~
        self._open = Opening(self.root, self.options, remote)
        self._read = ReadSide(self._open)
        self._write = WriteSide(self._open, gather=self._read.gather, announce=self._read.announce,
                                prefetch=lambda step, recipe: self._read.prefetch(step, None, None, recipe))
        # A script that commits and exits without close() must not lose the in-flight commit.
        ref = weakref.ref(self)
        self._atexit = lambda: (store := ref()) is not None and store.close()
        atexit.register(self._atexit)

    @property
    def _root(self) -> StoreRoot:
        """The open store (a reader's first use opens it; see :class:`~paramstore.opening.Opening`)."""
        return self._open.root

    @property
    def _pool(self) -> SlabPool | None:
        return self._open.pool

    # -- commit ------------------------------------------------------------------------------
    def commit(self, step: int, model: "torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]",
               *, tags: tuple[str, ...] | list[str] = (), metrics: Mapping[str, float] | None = None,
               metadata: Mapping[str, Any] | None = None, dtype: "torch.dtype | None" = None, group: Any = None,
               assets: AssetsArg = None, base: "VersionSpec | Version | None" = None,
               adapter_config: Any = None) -> CommitHandle:
        """Snapshot ``model``'s tensors as version ``step``; returns at once.

        The copy into shared memory runs on a background thread: ``handle.staged`` completes when
        it is taken (the trainer may then update its parameters; see :meth:`guard`), and
        ``handle.committed`` when the version is visible to every process. ``model`` may also be an
        iterable of ``(name, tensor)`` (streamed: each tensor is copied as it arrives, then
        dropped); DTensors make a sharded commit (every rank of their mesh calls ``commit``; each
        stores only its own blocks); a transformers model keeps its config files with the version.
        See ``docs/api.md`` ("Commit") for streaming, sharded commits and assets.

        Args:
            step: trainer step, a non-negative int above every committed step.
            model: a ``torch.nn.Module`` (its ``state_dict()``), a mapping of names to tensors, or
                an iterable of ``(name, tensor)``.
            tags: names to point at this version (a tag that exists is moved).
            metrics: numbers to record (ints, floats, NumPy scalars, one-element tensors).
            metadata: any JSON-serializable mapping to record.
            dtype: store floating-point tensors in this dtype (cast while copying).
            group: the process group whose ranks commit this version together (inferred from the
                DTensors' meshes when None).
            assets: files kept with the version: a directory or a mapping of names to bytes or paths.
            base: makes an *adapter version* of the version ``base`` (a step, tag, ``"latest"`` or
                :class:`Version`): ``model`` is then a PEFT model or a state dict of adapter weights
                with ``adapter_config`` (see :mod:`paramstore.adapters`); the base is kept as long as
                a version that names it.
            adapter_config: the adapter's config (a mapping, a PEFT config or the path of an
                ``adapter_config.json``) when ``model`` is a state dict.

        Returns:
            A :class:`CommitHandle`; ``handle.result()`` waits and returns the :class:`Version`.

        Raises:
            StepOrderError: ``step`` is not above the latest committed or in-flight step.
            TornCommitError: a tensor changed while it was being copied (see :meth:`guard`).
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
        self._open.check_open()
        return self._write.commit(step, model, tags=tags, metrics=metrics, metadata=metadata, dtype=dtype,
                                  group=group, assets=assets, base=base, adapter_config=adapter_config)

    def prepare(self, model: "torch.nn.Module | Mapping[str, torch.Tensor]", *, wait: bool = False,
                timeout: float | None = None) -> None:
        """Create and fault, in the background, the shared-memory buffers ``model``'s first commits
        will use (two commits' worth, more with recycling retention: as much as the run holds in
        steady state). Optional: without it the first commits fault fresh pages while copying.

        Raises:
            WaitTimeoutError: ``wait`` and not ready within ``timeout`` seconds.
            StorageFullError: ``wait`` and the filesystem had no room for the buffers.

        Example:
            >>> store.prepare(model, wait=True)  # at start-up, before the first commit
            >>> store.commit(2, model).result().step
            2
        """
        self._open.check_open()
        self._write.prepare(model, wait, check_timeout(timeout))

    def guard(self, optimizer: "torch.optim.Optimizer") -> Any:
        """Make ``optimizer.step()`` wait until the last commit's snapshot is taken.

        The wait is only as long as the copy still has to run; for parameters on an accelerator it
        is on the device (:meth:`CommitHandle.fence`). A failed commit is not re-raised here.
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
        def wait_for_staging(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if self._write.last_handle is not None:  # only wait: a failed commit reports through its handle
                self._write.last_handle.fence()

        return optimizer.register_step_pre_hook(wait_for_staging)

    def wait_staged(self, *, timeout: float | None = None) -> None:
        """Block until the last commit of this process is staged (re-raises its error).

        Example:
            >>> _ = store.commit(2, model)
            >>> store.wait_staged(timeout=60)  # the copy is taken: model may change from here on
        """
        self._write.wait_staged(timeout)

    def flush(self, *, timeout: float | None = None) -> Version | None:
        """Wait until every commit of this process is visible (and, with patches, its patches are
        made; with ``derive=``, its derived objects); returns the last version.

        Example:
            >>> for step in (2, 3):
            ...     _ = store.commit(step, model)
            >>> store.flush(timeout=60).step
            3
        """
        return self._write.flush(timeout)

    # -- read --------------------------------------------------------------------------------
    def checkout(self, version: VersionSpec = "latest", *, min_step: int | None = None,
                 timeout: float | None = None, holder: str | None = None, verify: bool = False,
                 device: "str | torch.device | None" = None, group: Any = None, src: int | None = None,
                 bucket_bytes: int | None = None, recipe: "str | Recipe | None" = None,
                 fetch: str = "eager") -> Snapshot:
        """Map a version's tensors zero-copy and hold a lease on it until the snapshot is closed.

        Objects fetched from peers or the remote are re-hashed before they are placed; objects
        already on this host are not (``verify=True`` costs one hash pass and catches damage).
        See ``docs/api.md`` ("Checkout") for devices and collective checkouts.

        Args:
            version: a step (int), ``"latest"``, or a tag (with a remote, one found only there is
                pulled first).
            min_step: instead of ``version``, the newest version whose step is ≥ ``min_step``;
                blocks until one exists (the staleness contract: ``min_step=t - η``).
            timeout: with ``min_step``, seconds to wait before raising WaitTimeoutError.
            holder: a name for the lease (shown by ``leases()``); default ``pid <pid>``.
            verify: re-hash every byte mapped; a damaged object is quarantined before the error.
            device: where the tensors live: None/``"cpu"`` (views of shared memory) or a torch
                device (CUDA IPC from a ``device_latest`` exporter, else copied in buckets).
            group: a ``torch.distributed`` group: every member calls ``checkout`` alike, and the
                version moves from member ``src`` to the others over the group, verified.
            src: with ``group``, the rank holding the version (default 0).
            bucket_bytes: with ``group``, the size of one broadcast (default 64 MiB).
            recipe: the version in the form an engine runs (a name from
                :func:`paramstore.recipes.names`, e.g. ``"fp8-block128"``, or a
                :class:`~paramstore.recipes.Recipe`): each tensor the recipe converts is replaced by
                its outputs (an FP8 weight and its scale), derived once per source object and kept
                in the store for every later checkout (:mod:`paramstore.derived`); the others are
                as committed. ``snap.recipe`` and ``snap.derived`` (what was derived now) tell.
                CPU only, not with ``group``.
            fetch: ``"eager"`` (the default): every object this host lacks is fetched (peers, then
                the remote; verified) before this returns. ``"lazy"``: nothing is fetched; the
                version is leased and this returns at once, and each read (``snap.read(name,
                offsets, sizes)``, ``snap[name]``, ``snap.load_into(module)``, ``snap.assets``)
                first moves the pieces it touches (2 MiB pieces of a large tensor, a small tensor
                whole) from a peer that holds the object, else the remote, each verified against
                the manifest before any byte is handed out, and kept for later reads of the
                snapshot. A rank reading a quarter of a tensor moves about a quarter of it.
                ``snap.fetch.lazy_bytes`` and ``bytes_from`` say what moved; a peer that serves a
                bad piece is named in ``snap.fetch.rejected`` and not asked again. CPU only; not
                with ``verify``, ``group`` or ``recipe``. See :mod:`paramstore.lazy`.

        Returns:
            A :class:`Snapshot`: a read-only ``Mapping[str, Tensor]`` with ``.version``, ``.step``,
            ``.digest``, ``.fetch``, ``.load_into(module)`` and ``.close()``.

        Raises:
            VersionNotFoundError / TagNotFoundError: no such version or tag.
            WaitTimeoutError: no version with step ≥ ``min_step`` within ``timeout``.
            CorruptObjectError: an object is truncated, malformed or (``verify``) damaged.
            ObjectUnavailableError: an object no peer nor the remote delivers (with ``fetch="lazy"``,
                raised by the read that needs it, naming the tensor).
            DeviceError: ``device`` is not available. BroadcastError: (``group``) it failed somewhere.

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
            >>> with store.checkout(1, fetch="lazy") as snap:  # reads move what they touch (here: all local)
            ...     snap.lazy, snap.read("0.weight", (2, 0), (3, 4)).shape, snap.fetch.lazy_bytes
            (True, torch.Size([3, 4]), 0)
            >>> with store.checkout(1, recipe="fp8-block128") as snap:  # derived now, kept for the next one
            ...     snap["0.weight"].dtype, snap["0.weight_scale_inv"].shape, snap["0.bias"].dtype
            (torch.float8_e4m3fn, torch.Size([1, 1]), torch.float32)
            >>> with store.checkout(1, recipe="fp8-block128") as snap:  # nothing derived again
            ...     snap.derived.derived, snap.derived.units
            (0, 1)
        """
        self._open.check_open()
        return self._read.checkout(version, min_step=min_step, timeout=timeout, holder=holder, verify=verify,
                                   device=device, group=group, src=src, bucket_bytes=bucket_bytes, recipe=recipe,
                                   fetch=fetch)

    def prefetch(self, version: VersionSpec = "latest", *, min_step: int | None = None,
                 timeout: float | None = None, recipe: "str | Recipe | None" = None) -> Future[Version]:
        """Bring a version's objects to this host in the background (from patches, peers or the
        remote, verified, as a checkout would), so that its :meth:`checkout` then moves no bytes
        (``snap.fetch.moved`` is False): a rollout prefetches the next version while it generates,
        and pauses only to install. The same forms as ``checkout`` (a step, ``"latest"``, a tag,
        or ``min_step=`` with ``timeout=``); prefetches run one after another, in the order asked.
        The objects stay until the version is pruned (a prefetch holds no lease once done).
        With ``recipe`` (see :meth:`checkout`) the derived objects are made too, so that
        ``checkout(v, recipe=...)`` derives nothing.

        Returns:
            A ``concurrent.futures.Future`` of the :class:`Version`, done once every object is
            here; it fails with the error a checkout would raise (StoreClosedError if the store
            is closed first).

        Example:
            >>> future = store.prefetch(min_step=2, timeout=60)  # the next version, when it comes
            >>> _ = store.commit(2, model).result()  # (a trainer, elsewhere)
            >>> future.result(timeout=60).step
            2
            >>> with store.checkout(2) as snap:
            ...     snap.fetch.moved
            False
        """
        self._open.check_open()
        return self._read.prefetch(version, min_step, timeout, recipe)

    def follow_commit(self, step: int, *, timeout: float | None = None, holder: str | None = None) -> FollowedCommit:
        """Read version ``step`` while it is being committed on this host: each tensor as soon as its
        copy into shared memory is done, the rest once the version is published.

        For a reader that installs the weights (a rollout engine copying them into its own) and
        would otherwise wait for the whole commit: its copies then overlap the trainer's. A
        streaming commit (``commit(step, iterable)``) on this host keeps a journal of what it has
        staged (:mod:`paramstore.following`); any other commit (a state dict, a sharded commit, a
        commit on another host, one already published) is read from its version once published,
        fetched and verified as a checkout's. Bytes read from staging are exactly those the
        version's digests cover: the commit never changes them while a reader holds them.

        Iterating the result yields ``(name, tensor)`` (CPU, mapping shared memory copy-on-write),
        each unchanging until the next pair is asked for (copy it before); it ends once the
        version is published and every tensor of it was yielded, once. ``.version`` is then the
        :class:`Version` and ``.snapshot`` its checkout (leased until ``close()``).

        Args:
            step: the step to read (exactly; a commit of another step is not followed).
            timeout: seconds to wait, for the commit to start and for it to end (None: forever).
            holder: a name for the lease on the version (see :meth:`checkout`).

        Returns:
            A :class:`~paramstore.following.FollowedCommit` (iterate it once; a context manager).

        Raises (while iterating):
            VersionNotFoundError: the commit failed or its writer died (the message says which;
                ``.served`` lists the names already yielded), or a newer version was published
                and not this step.
            WaitTimeoutError: the version was not published within ``timeout``.

        Example:
            >>> import threading
            >>> weights = [(n, p.detach() + 1) for n, p in model.named_parameters()]
            >>> trainer = threading.Thread(target=lambda: store.commit(2, iter(weights)).result())
            >>> trainer.start()
            >>> with store.follow_commit(2, timeout=60) as followed:
            ...     got = {name: tensor.clone() for name, tensor in followed}  # install each as it comes
            >>> trainer.join()
            >>> followed.version.step, all(torch.equal(got[n], t) for n, t in weights)
            (2, True)
        """
        self._open.check_open()
        return FollowedCommit(self, step, timeout=check_timeout(timeout), holder=holder)

    def versions(self) -> list[Version]:
        """Every version, in increasing step order.

        Example:
            >>> _ = store.commit(2, model, tags=["best"]).result()
            >>> [(v.step, v.tags) for v in store.versions()]
            [(1, ()), (2, ('best',))]
        """
        self._open.check_open()
        return list(self._root.registry.versions())

    def latest(self) -> Version | None:
        """The newest version, or None if the store is empty or not created yet.

        Example:
            >>> v = store.latest()
            >>> v.step, v.num_tensors, v.nbytes
            (1, 4, 232)
        """
        self._open.check_open()
        step = None if self._open.not_created() else self._root.registry.latest_step()
        return None if step is None else self._root.registry.get_version(step)

    def get(self, version: VersionSpec) -> Version:
        """The :class:`Version` named by a step, ``"latest"`` or a tag.

        Example:
            >>> _ = store.tag(1, "release")
            >>> store.get("release") == store.get(1) == store.get("latest")
            True
        """
        self._open.check_open()
        return self._root.registry.get_version(self._read.resolve(version))

    def manifest(self, version: VersionSpec = "latest") -> Manifest:
        """The :class:`~paramstore.Manifest` of a version: where each tensor lies, its dtype, shape, digest.

        Example:
            >>> store.manifest("latest").entry("0.weight").shape
            (8, 4)
        """
        self._open.check_open()
        return self._root.registry.get_manifest(self._read.resolve(version))

    # -- waiting and staleness -----------------------------------------------------------------
    def subscribe(self, *, min_step: int | None = None, timeout: float | None = None) -> Iterator[Version]:
        """Yield every new version in step order as it becomes visible, from any process (no busy
        spinning); with ``min_step``, those with step ≥ ``min_step`` already visible first.
        ``timeout`` ends the iteration after that many idle seconds.

        Example:
            >>> _ = store.commit(2, model).result()
            >>> [v.step for v in store.subscribe(min_step=1, timeout=0.1)]  # ends after 0.1 s idle
            [1, 2]
        """
        self._open.check_open()
        return self._read.subscribe(min_step, timeout)

    def wait_for(self, step: int, *, timeout: float | None = None) -> Version:
        """Block until a version with step ≥ ``step`` is visible; return the newest one.

        Raises WaitTimeoutError: none appeared within ``timeout`` seconds.

        Example:
            >>> store.wait_for(3, timeout=0.1)
            Traceback (most recent call last):
            ...
            paramstore.errors.WaitTimeoutError: no version with step >= 3 within 0.1 s (latest: 1)
        """
        self._open.check_open()
        return self._read.wait_for(step, timeout)

    def leases(self) -> list[Lease]:
        """Live leases: which versions readers hold, by whom, since when.

        Example:
            >>> with store.checkout(1, holder="rollout-0"):
            ...     [(lease.step, lease.holder) for lease in store.leases()]
            [(1, 'rollout-0')]
        """
        self._open.check_open()
        return [] if self._open.not_created() else self._root.registry.leases()

    def oldest_leased_step(self) -> int | None:
        """The oldest step any live reader holds (how far behind the slowest reader is), or None.

        Example:
            >>> store.oldest_leased_step() is None
            True
        """
        return min((lease.step for lease in self.leases()), default=None)

    def wait_for_readers(self, min_step: int, *, timeout: float | None = None) -> None:
        """Block until no live lease is on a version older than ``min_step``: with
        ``checkout(min_step=t - η)`` on the rollout side, ``wait_for_readers(t - η)`` before step t
        makes t − v ≤ η a store guarantee. A reader that dies stops counting at once.

        Raises WaitTimeoutError: readers still hold older versions after ``timeout`` seconds.

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
        self._open.check_open()
        self._write.wait_for_readers(min_step, timeout)

    # -- peers and remote ----------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", *, transport: Transport | None = None) -> PeerServer:
        """Serve this host's objects to other hosts through the transport, announcing them in the
        (shared) registry; checkouts in this process then announce what they fetch too. The
        Mooncake engine has no authentication: ``host`` must be on a private network.

        Example (not run: it starts a transfer engine)::

            server = ParamStore(root, registry=redis_url, name="run-42").serve("10.0.0.7")
        """
        self._open.check_open()
        return self._read.serve(host, transport)

    @property
    def remote(self) -> Remote | None:
        """The remote tier, if configured.

        Example:
            >>> store.remote is None  # opened without remote=
            True
        """
        return self._open.remote

    def _need_remote(self) -> Remote:
        self._open.check_open()
        if self._open.remote is None:
            raise InvalidArgumentError("this store has no remote; open it with ParamStore(root, remote=URL)")
        return self._open.remote

    def push(self, version: VersionSpec = "latest", *, show_progress: bool | None = None) -> TransferReport:
        """Upload a local version to the remote now (blocking; only objects it lacks).

        Example:
            >>> with paramstore.ParamStore(root) as store:  # committed before there was a remote
            ...     store.commit(1, model).result().step
            1
            >>> with paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options) as store:
            ...     report = store.push(1)
            ...     report.step, report.objects, store.push(1).objects  # the second: already there
            (1, 1, 0)
        """
        remote, step = self._need_remote(), self._root.resolve(version)
        if self.options.registry is not None:
            self._read.gather(step)
        return remote.push(self._root, step, show_progress=show_progress)

    def pull(self, version: VersionSpec = "latest", *, show_progress: bool | None = None) -> TransferReport:
        """Download a remote version into this store (verified), without checking it out.

        Example:
            >>> with paramstore.ParamStore(root + "/trainer", remote=bucket_url,
            ...                            storage_options=storage_options) as trainer:
            ...     trainer.commit(1, model).persisted.result().step
            1
            >>> with paramstore.ParamStore(root + "/other-host", remote=bucket_url,
            ...                            storage_options=storage_options) as store:
            ...     store.pull(1).objects, [v.step for v in store.versions()]
            (1, [1])
        """
        remote = self._need_remote()
        return remote.pull(self._root, remote.resolve(version), show_progress=show_progress)

    def remote_versions(self) -> list[Version]:
        """Every complete version in the remote, in increasing step order (RemoteError when no
        paramstore remote lives at the URL yet: a read never creates one).

        Example:
            >>> with paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options) as store:
            ...     _ = store.commit(1, model, metrics={"reward": 0.5}).persisted.result()
            ...     [(v.step, v.metrics) for v in store.remote_versions()]
            [(1, {'reward': 0.5})]
        """
        return self._need_remote().versions()

    def persisted(self) -> dict[int, str]:
        """Local versions known to be durable in a remote: step -> remote URL.

        Example:
            >>> with paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options) as store:
            ...     _ = store.commit(1, model).persisted.result()
            ...     store.persisted() == {1: bucket_url}
            True
        """
        self._open.check_open()
        return self._root.registry.persisted()

    def wait_persisted(self, *, timeout: float | None = None) -> None:
        """Block until every version committed so far is pushed (or failed). Raises WaitTimeoutError.

        Example:
            >>> with paramstore.ParamStore(root, remote=bucket_url, storage_options=storage_options) as store:
            ...     _ = [store.commit(step, model) for step in (1, 2)]
            ...     store.wait_persisted(timeout=60)
            ...     sorted(store.persisted())
            [1, 2]
        """
        self._write.wait_persisted(timeout)

    # -- inspection and maintenance ------------------------------------------------------------
    def verify(self, version: VersionSpec | None = None, *, repair: bool = False,
               show_progress: bool | None = False) -> dict[str, Any]:
        """Re-hash the objects of one version (or of every version) and check every manifest entry;
        ``repair=True`` quarantines damaged objects and fetches good copies (from peers or the
        remote). Returns a report (``ok``, ``corrupt``, ``missing``, ``advice``...; see
        :func:`paramstore.ops.verify`).

        Example:
            >>> report = store.verify()
            >>> report["ok"], report["versions_checked"], report["corrupt"], report["advice"]
            (True, 1, {}, '')
        """
        self._open.check_open()
        report = ops.verify(self._root, None if version is None else [self._root.resolve(version)],
                            show_progress=show_progress)
        return ops.repair(self._root, self._read.fetcher, report) if repair else report

    def remove(self, version: VersionSpec) -> Version:
        """Remove a version for good (one ``verify(repair=True)`` could not repair); its objects go
        at the next :meth:`gc`. Refused while leased, and for the latest. Returns its record.

        Example:
            >>> _ = store.commit(2, model).result()
            >>> store.remove(1).step, [v.step for v in store.versions()]
            (1, [2])
        """
        self._open.check_open()
        return ops.remove_version(self._root, self._root.resolve(version))

    def patches(self, version: VersionSpec | None = None) -> dict[tuple[int, int], dict[str, int]]:
        """The patches recorded (of ``version`` as their target, when given): ``(base, target) ->
        {"objects", "bytes", "changed"}`` (see :mod:`paramstore.delta`).

        Example:
            >>> store.patches()  # a single-host store makes none unless patches=True
            {}
        """
        self._open.check_open()
        return patch_summary(self._root, None if version is None else self._root.resolve(version))

    def du(self) -> dict[str, Any]:
        """Logical bytes (every version's tensors) against bytes stored, and the dedup ratio.

        Example:
            >>> _ = store.commit(2, model).result()  # unchanged tensors: stored once
            >>> report = store.du()
            >>> report["versions"], report["objects"], report["logical_bytes"]
            (2, 1, 464)
        """
        self._open.check_open()
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
        self._open.check_open()
        return ops.diff(self._root, self._root.resolve(a), self._root.resolve(b))

    def export(self, version: VersionSpec, directory: str | os.PathLike[str], *,
               shard_size_bytes: int | None = None, show_progress: bool | None = False,
               assets_from: str | os.PathLike[str] | None = None, weights_only: bool = False,
               recipe: "str | Recipe | None" = None) -> dict[str, Any]:
        """Write a version as a Hugging Face model directory (shards, index, assets) that
        ``from_pretrained`` and ``vllm.LLM(model=...)`` load as it is (see
        :func:`paramstore.export.export` for ``assets_from`` and ``weights_only``). With ``recipe``
        (see :meth:`checkout`) the tensors are written in the recipe's form and its
        ``quantization_config`` is merged into ``config.json``.

        Example:
            >>> out = store.export("latest", root + "/hf", weights_only=True)  # a plain module: no config
            >>> out["files"], out["step"], out["total_size"]
            (['model-00001-of-00001.safetensors', 'model.safetensors.index.json'], 1, 232)
        """
        self._open.check_open()
        return export(self._root, self._root.resolve(version), os.fspath(directory),
                      shard_size_bytes=DEFAULT_EXPORT_SHARD_BYTES if shard_size_bytes is None else shard_size_bytes,
                      show_progress=show_progress, assets_from=assets_from, weights_only=weights_only,
                      recipe=recipe)

    def prune(self, policy: Policy, *, dry_run: bool = False, tier: str = "local") -> PruneReport:
        """Remove the versions ``policy`` does not keep (never the latest, never a leased one);
        ``tier="remote"`` prunes the remote. Objects are reclaimed by :meth:`gc`.

        Example:
            >>> from paramstore.retention import AnyOf, KeepLast, KeepBest
            >>> for step, reward in [(2, 0.9), (3, 0.1), (4, 0.2), (5, 0.3)]:
            ...     _ = store.commit(step, model, metrics={"reward": reward})
            >>> _ = store.flush()
            >>> report = store.prune(AnyOf(KeepLast(2), KeepBest(1, "reward", mode="max")))
            >>> report.removed, report.kept[2]
            ([1, 3], ['best 1 by reward (max)'])
        """
        self._open.check_open()
        if _tier(tier) == "remote":
            return maintenance.prune_remote(self._need_remote(), policy, dry_run=dry_run)
        return maintenance.prune(self._root, policy, dry_run=dry_run)

    def gc(self, *, dry_run: bool = False, tier: str = "local", grace: float | None = None) -> GcReport:
        """Delete objects and temporary files no surviving version (or live commit) references;
        ``tier="remote"``: the remote's, sparing objects younger than ``grace`` seconds.

        Example:
            >>> from paramstore.retention import KeepLast
            >>> with torch.no_grad():
            ...     _ = [p.add_(1.0) for p in model.parameters()]  # step 2 shares no object with step 1
            >>> _ = store.commit(2, model).result()
            >>> store.prune(KeepLast(1)).removed, len(store.gc().objects), store.gc().objects
            ([1], 1, [])
        """
        self._open.check_open()
        if _tier(tier) == "remote":
            return maintenance.gc_remote(self._need_remote(), dry_run=dry_run, grace=check_timeout(grace, "grace"))
        if grace is not None:
            raise InvalidArgumentError("grace= applies to the remote tier only (gc(tier='remote', grace=...)); the "
                                       "local GC never deletes what a version or a live commit references")
        return maintenance.gc(self._root, dry_run=dry_run)

    def tag(self, version: VersionSpec, name: str) -> Version:
        """Point tag ``name`` at ``version`` (moving it if it exists); returns that version.

        Example:
            >>> store.tag("latest", "release").tags
            ('release',)
        """
        self._open.check_open()
        step = self._read.resolve(version)
        self._root.registry.set_tag(check_tag(name), step)
        return self._root.registry.get_version(step)

    def untag(self, name: str) -> int:
        """Remove tag ``name``; returns the step it pointed at (TagNotFoundError if none).

        Example:
            >>> _ = store.tag(1, "candidate")
            >>> store.untag("candidate"), store.get(1).tags
            (1, ())
        """
        self._open.check_open()
        return self._root.registry.delete_tag(check_tag(name))

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight commits (and their uploads), then close the write side, the read side
        and the root, in that order (the reverse of opening). Idempotent.

        Example:
            >>> handle = store.commit(2, model)
            >>> store.close()  # waits for step 2
            >>> handle.done(), store.close()
            (True, None)
        """
        if not self._open.mark_closed():
            return
        atexit.unregister(self._atexit)
        self._write.wait_streaming()  # a streaming commit being staged on another thread is queued first
        if self._open.opened is None:
            self._write.destroy_groups()
            return
        if os.getpid() == self._open.owner:  # a forked child leaves the parent's threads alone
            self._write.close()
            self._read.close()
        self._open.close()

    def __enter__(self) -> "ParamStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ParamStore({self.root!r})"


def _tier(name: str) -> str:
    if name not in maintenance.TIERS:
        raise InvalidArgumentError(f"unknown tier {name!r}; known tiers: {', '.join(maintenance.TIERS)}")
    return name
