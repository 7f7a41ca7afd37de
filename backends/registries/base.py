"""The registry contract: the metadata side of a store.

A registry keeps versions, manifests, tags and the tensor index (tensor digest -> where its bytes
already lie) and tells waiting processes that something changed. Object bytes never pass through
it. Implementations must make :meth:`Registry.publish` atomic: a version, its manifest, its tags
and its index entries appear together or not at all.

It also keeps *peer announcements*: which per-host peer process serves which object, at which
address of its registered memory (:meth:`Registry.announce_peer`, :meth:`Registry.holders`). A
peer and everything it announced go when it is withdrawn, when the registry object that announced
it is closed, or when its process dies (found by whoever reads next, or by a TTL).

Notes for implementers (a new registry passes the shipped conformance suite,
:class:`paramstore.backends.registries.testing.RegistryTests`: subclass it in a pytest module with a
fixture describing a fresh store and a method opening it; ``tests/test_registry_contract.py`` does
so for LMDB and Redis):

* **Primitives and defaults.** The abstract methods of :class:`Registry` are its primitives: a new
  registry implements those only. The others (``latest_step``, ``get_version``, ``tags``,
  ``object_sizes``, ``referenced_objects``, ``stores``) have defaults built on the primitives
  (``versions``, ``get_manifest``, ``objects``, ``patches``); override one where the backing store
  answers it faster (both shipped registries do, and say so), never to change what it returns.
* **Atomicity.** ``publish``, ``remove_versions``, ``acquire_lease`` and ``forget_objects`` are each
  one transaction (LMDB: a write transaction; Redis: one Lua script). ``acquire_lease`` and
  ``remove_versions`` must exclude each other: a prune either sees the lease or the lease fails.
  ``publish`` and ``forget_objects`` too: a publish checks, in its transaction, that every object
  its manifest references is registered or registered by it (UnregisteredObjectsError otherwise),
  so no version ever references an object the registry does not record.
* **Liveness.** A lease or a peer belongs to a process; when the process dies the registry forgets
  it without anyone's help (LMDB: pid and start time checked by readers; Redis: TTL keys renewed by
  a heartbeat thread). Document the delay.
* **Fork.** One registry object per process: an implementation reopens its handles in a forked
  child and never releases its parent's leases or peers there.
* **Validation.** Digests, peer ids and addresses come from other hosts: validate them
  (``check_digests``, ``check_peer``...) before they are stored or returned.
* **Wake-ups.** ``watch()`` must not busy-spin and must not lose a change made after it returned.
* **Patches.** ``add_patches`` registers the patch objects (as objects of no tensors) and its
  record in one transaction, only while both versions exist; ``remove_versions`` drops the records
  whose base or target it removes, in its own transaction; ``referenced_objects`` includes the
  patch objects of every record (so GC keeps them exactly as long as their record).
"""

from __future__ import annotations

import abc
import re
from typing import ClassVar, Iterable, Iterator, Mapping, NamedTuple

from paramstore.errors import InvalidArgumentError, UnregisteredObjectsError, VersionNotFoundError
from paramstore.manifest import Manifest, Version
from paramstore.validate import check_digest

__all__ = ["check_patches", "Registry", "TensorLocation", "Watch", "Lease", "ObjectInfo", "Peer", "META_KEYS", "check_meta_key",
           "check_derived_key", "MAX_DERIVED_RECORD_BYTES"]

#: Store-level values a registry keeps (:meth:`Registry.get_meta`): the store's identity, written
#: when it is created and checked by every open, the current writer (see ``paramstore.writer``),
#: and the run id of the writer that makes patches (see ``paramstore.delta``).
META_KEYS = ("store_id", "writer", "patches")


#: The longest derived record a registry accepts (:meth:`Registry.swap_derived`).
MAX_DERIVED_RECORD_BYTES = 16 << 20
_DERIVED_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_derived_key(key: object) -> str:
    """``key`` if it names a derived record (``<recipe>@<version>/<unit>``: letters, digits and
    ``._@+-``), else InvalidArgumentError."""
    if not isinstance(key, str) or not _DERIVED_KEY.fullmatch(key):
        raise InvalidArgumentError(f"not a derived record's key (<recipe>@<version>/<unit>): {key!r}")
    return key


def check_derived_record(record: object) -> bytes:
    """``record`` as bytes if it is non-empty UTF-8 of at most :data:`MAX_DERIVED_RECORD_BYTES` bytes."""
    if not isinstance(record, (bytes, bytearray)) or not record or len(record) > MAX_DERIVED_RECORD_BYTES:
        raise InvalidArgumentError(f"a derived record is 1 to {MAX_DERIVED_RECORD_BYTES} bytes, got "
                                   f"{len(record) if isinstance(record, (bytes, bytearray)) else type(record).__name__}")
    try:
        bytes(record).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError("a derived record is UTF-8 text (JSON)") from None
    return bytes(record)


def check_meta_key(key: object) -> str:
    """``key`` if it is one of :data:`META_KEYS`, else InvalidArgumentError."""
    if key not in META_KEYS:
        raise InvalidArgumentError(f"unknown store-level key {key!r}: one of {', '.join(META_KEYS)}")
    return key  # type: ignore[return-value]


class Lease(NamedTuple):
    """A reader's hold on a version: while it is live, the version is not pruned."""

    id: str
    step: int
    holder: str
    pid: int
    host: str
    acquired_at: float


class Peer(NamedTuple):
    """A per-host server process that serves the objects its host holds to other hosts."""

    id: str  # unique per peer process (e.g. a uuid's hex); letters, digits and ``._:-``, at most 128
    session: str  # transport address other hosts connect to, e.g. "10.0.0.5:15012"
    host: str  # host name
    pid: int
    started_at: float  # time.time() at announce


_PEER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")


def check_peer_id(peer_id: object) -> str:
    """``peer_id`` if it is a valid peer id, else InvalidArgumentError."""
    if not isinstance(peer_id, str) or not _PEER_ID.match(peer_id):
        raise InvalidArgumentError(f"a peer id is 1-128 letters, digits or '._:-', got {peer_id!r}")
    return peer_id


def check_peer(peer: object) -> Peer:
    """``peer`` as a :class:`Peer` if its fields are valid, else InvalidArgumentError."""
    if not isinstance(peer, Peer):
        raise InvalidArgumentError(f"expected a Peer, got {type(peer).__name__}")
    check_peer_id(peer.id)
    for field in ("session", "host"):
        if not isinstance(getattr(peer, field), str) or not getattr(peer, field):
            raise InvalidArgumentError(f"Peer.{field} must be a non-empty string, got {getattr(peer, field)!r}")
    if isinstance(peer.pid, bool) or not isinstance(peer.pid, int) or peer.pid <= 0:
        raise InvalidArgumentError(f"Peer.pid must be a positive int, got {peer.pid!r}")
    if isinstance(peer.started_at, bool) or not isinstance(peer.started_at, (int, float)):
        raise InvalidArgumentError(f"Peer.started_at must be a number, got {peer.started_at!r}")
    return peer


def check_digests(digests: Iterable[str]) -> list[str]:
    """The distinct object digests (64 lowercase hex digits) in ``digests``, in order."""
    if isinstance(digests, (str, bytes)) or not isinstance(digests, Iterable):
        raise InvalidArgumentError(f"expected an iterable of digests, got a {type(digests).__name__}")
    out = list(digests)
    for d in out:  # before dict.fromkeys: a list or dict among them (hostile JSON) is not hashable
        check_digest(d)
    return list(dict.fromkeys(out))


def check_holdings(objects: Mapping[str, int]) -> dict[str, int]:
    """``objects`` (digest -> address) checked: addresses are ints in [0, 2**64)."""
    if not isinstance(objects, Mapping):
        raise InvalidArgumentError(f"expected a mapping digest -> address, got {type(objects).__name__}")
    check_digests(objects)
    for d, address in objects.items():
        if isinstance(address, bool) or not isinstance(address, int) or not 0 <= address < 1 << 64:
            raise InvalidArgumentError(f"the address of {d} must be an int in [0, 2**64), got {address!r}")
    return dict(objects)


def check_limit(limit: object) -> int | None:
    """``limit`` if it is None or an int >= 1 (:meth:`Registry.holders`), else InvalidArgumentError."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"a limit is None or an int >= 1, got {limit!r}")
    return limit


def check_positions(positions: Iterable[int]) -> list[int]:
    """The distinct ``positions``, in order, if each is an int in [0, 2**53)
    (:meth:`Registry.in_order`), else InvalidArgumentError."""
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
        raise InvalidArgumentError(f"expected an iterable of positions, got a {type(positions).__name__}")
    out = list(positions)
    for p in out:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < 1 << 53:
            raise InvalidArgumentError(f"a position is an int in [0, 2**53), got {p!r}")
    return list(dict.fromkeys(out))


def unregistered(step: int, digests: Iterable[str]) -> UnregisteredObjectsError:
    """The error :meth:`Registry.publish` raises for a version at ``step`` that references objects
    the registry does not record (``digests``) and does not register either."""
    missing = sorted(digests)
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    return UnregisteredObjectsError(
        f"step {step} references {len(missing)} object(s) the registry no longer records ({', '.join(missing[:3])}"
        f"{more}): GC on another host forgot them after this commit deduplicated against them; nothing was "
        "published (register them with the version and publish again)", digests=set(missing))


def check_patches(base: object, target: object, patches: object) -> dict[str, tuple[str, int]]:
    """The arguments of :meth:`Registry.add_patches` checked: steps with ``0 <= base < target``,
    target and patch objects as digests, sizes positive ints."""
    for what, step in (("base", base), ("target", target)):
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 64:
            raise InvalidArgumentError(f"a patch's {what} must be a step (int >= 0), got {step!r}")
    if base >= target:  # type: ignore[operator]
        raise InvalidArgumentError(f"a patch's base ({base}) must be older than its target ({target})")
    if not isinstance(patches, Mapping):
        raise InvalidArgumentError(f"expected a mapping target object -> (patch object, size), got {patches!r}")
    out = {}
    for obj, entry in patches.items():
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise InvalidArgumentError(f"the patch of {obj!r} must be (patch object, size), got {entry!r}")
        patch, size = entry
        check_digests([obj, patch])
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidArgumentError(f"the size of patch {patch} must be a positive int, got {size!r}")
        out[obj] = (patch, size)
    return out


class TensorLocation(NamedTuple):
    """Where a tensor's bytes already lie: object digest, absolute offset, length."""

    object: str
    offset: int
    nbytes: int


class ObjectInfo(NamedTuple):
    """A stored object: its size and the digests of the tensors it holds (in file order)."""

    size: int
    tensors: tuple[str, ...]


class Watch(abc.ABC):
    """A handle that wakes up when the registry may have changed."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until a change since the last wait (or since arming), or ``timeout`` seconds.

        Returns False on timeout. Spurious wake-ups are allowed; callers re-read the state.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching."""

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Registry(abc.ABC):
    """Metadata of one store, opened per process (an implementation reopens itself after ``fork``).

    The abstract methods are the primitives a registry implements; the concrete ones are defaults
    built on them (see the module's notes for implementers).
    """

    #: Capability flag: the registry is shared by several hosts (Redis), not one host's own (LMDB).
    #: The core asks it instead of testing classes: only a shared registry has peers on other hosts
    #: to fetch from, and there the records of an object damaged here stay (other hosts may hold good
    #: copies) where one host's registry forgets them. True unless a registry says otherwise: the
    #: cautious answer for a registry that does not know.
    shared: ClassVar[bool] = True

    # -- versions (primitives: versions, get_manifest) ------------------------------------------
    def latest_step(self) -> int | None:
        """The newest committed step, or None for an empty store.

        Note for implementers: the default reads every version (:meth:`versions`); override it
        with a lookup of the newest one.
        """
        return max((v.step for v in self.versions()), default=None)

    def get_version(self, step: int) -> Version:
        """The version at ``step`` (tags joined). Raises VersionNotFoundError.

        Note for implementers: the default reads the versions from ``step`` on (:meth:`versions`)
        and stops at the first; override it with a lookup of the one key.
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 64:
            raise VersionNotFoundError(f"no version at step {step}")
        for version in self.versions(after=step - 1):
            if version.step == step:
                return version
            break
        raise VersionNotFoundError(f"no version at step {step}")

    @abc.abstractmethod
    def get_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``. Raises VersionNotFoundError."""

    @abc.abstractmethod
    def versions(self, after: int | None = None) -> Iterator[Version]:
        """Versions in increasing step order, only those with step > ``after`` when given."""

    def tags(self) -> dict[str, int]:
        """Every tag and the step it points at.

        Note for implementers: the default collects the tags :meth:`versions` joins to each
        version; override it where the tags can be read on their own.
        """
        return {name: version.step for version in self.versions() for name in version.tags}

    @abc.abstractmethod
    def set_tag(self, name: str, step: int) -> None:
        """Point ``name`` at ``step`` (moving it if it exists). Raises VersionNotFoundError."""

    @abc.abstractmethod
    def delete_tag(self, name: str) -> int:
        """Remove ``name``; returns the step it pointed at. Raises TagNotFoundError."""

    @abc.abstractmethod
    def locate_tensors(self, digests: list[str]) -> dict[str, TensorLocation]:
        """For the digests already stored, where their bytes lie."""

    @abc.abstractmethod
    def objects(self) -> dict[str, int]:
        """Every registered object digest and its size in bytes."""

    def object_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """Sizes of the registered objects among ``digests`` (unregistered ones are left out).

        A checkout that lacks some objects asks this for just those. Note for implementers: the
        default reads the whole :meth:`objects` map; override it with a lookup of the given keys.
        """
        wanted = set(check_digests(digests))
        return {d: n for d, n in self.objects().items() if d in wanted}

    @abc.abstractmethod
    def publish(
        self,
        version: Version,
        manifest: Manifest,
        new_objects: dict[str, ObjectInfo],
        new_tensors: dict[str, TensorLocation],
        *,
        require_newest: bool = True,
    ) -> None:
        """Make ``version`` visible, atomically, with its manifest, tags and index entries.

        Called only after every object the manifest references is durable in the tier. Every object
        the manifest references must be registered when the transaction runs, before or by this
        very publish (``new_objects``): otherwise nothing is written and UnregisteredObjectsError
        names the missing ones (on a registry shared by hosts, another host's GC may forget an
        object between a commit's dedup lookup and its publish; the committer then registers it
        again, see ``paramstore.commit``). Raises StepOrderError if ``version.step`` is not above the latest step (with
        ``require_newest``, as for a commit) or, without it, if the step already exists (a
        version restored from a remote may be older than the latest).
        """

    @abc.abstractmethod
    def set_persisted(self, step: int, remote: str) -> None:
        """Record that version ``step`` is durable in the remote at URL ``remote``.

        Raises VersionNotFoundError. The mark goes when the version is removed.
        """

    @abc.abstractmethod
    def persisted(self) -> dict[int, str]:
        """Every version known to be durable in a remote: step -> remote URL."""

    @abc.abstractmethod
    def get_meta(self, key: str) -> str | None:
        """The store-level value ``key`` (one of :data:`META_KEYS`), or None if it was never set."""

    @abc.abstractmethod
    def swap_meta(self, key: str, expected: str | None, value: str) -> str | None:
        """Set ``key`` to ``value`` if it now holds ``expected`` (None: unset), in one transaction.

        Returns what ``key`` holds afterwards: ``value`` when the swap happened, else the current
        value (so the caller sees who won). ``key`` is one of :data:`META_KEYS`.
        """

    def stores(self) -> dict[str, str | None] | None:
        """The stores this registry's server holds, by name: name -> store id (None if its id was
        never set), for messages about a mistyped name; None where a registry holds one store."""
        return None

    @abc.abstractmethod
    def acquire_lease(self, step: int, holder: str) -> Lease:
        """Hold version ``step`` for the calling process. Raises VersionNotFoundError if it is gone.

        The check and the lease are one transaction, so a concurrent prune either sees the lease
        or makes this call fail.
        """

    @abc.abstractmethod
    def release_lease(self, lease_id: str) -> None:
        """Release a lease (no error if it is already gone) and wake watchers."""

    @abc.abstractmethod
    def leases(self) -> list[Lease]:
        """Every live lease. Leases of dead processes are released here, with nobody's help."""

    @abc.abstractmethod
    def remove_versions(self, steps: list[int]) -> list[int]:
        """Delete these versions (with their tags) in one transaction; returns those removed.

        Never removes the latest version or a version with a live lease (checked inside the
        transaction). Objects are not touched: see :meth:`referenced_objects` and GC.
        """

    def referenced_objects(self) -> set[str]:
        """Digests of the objects any version references, and the patch objects of every patch
        record (the mark phase of GC).

        Note for implementers: the default reads every version's manifest (:meth:`versions`,
        :meth:`get_manifest`; a version removed meanwhile references nothing any more), then every
        patch record (:meth:`patches`); override it where the references are kept as such.
        """
        out: set[str] = set()
        for version in self.versions():
            try:
                out.update(self.get_manifest(version.step).objects())
            except VersionNotFoundError:
                continue
        for record in self.patches().values():
            out.update(record.values())
        return out

    # -- patches -----------------------------------------------------------------------------
    @abc.abstractmethod
    def add_patches(self, base: int, target: int, patches: Mapping[str, tuple[str, int]]) -> bool:
        """Record patches that rebuild objects of version ``target`` from the objects of version
        ``base``: ``{target object: (patch object, patch size)}``, merged with those already
        recorded for the pair. The patch objects are registered as objects (no tensors). An empty
        mapping records that the pair's patches were made and none was worth keeping (a reader
        waiting for them stops waiting). Wakes watchers of ``"versions"``.

        Called only after the patch objects are durable in the tier. Returns False, recording
        nothing, when either version is gone (a prune won); raises InvalidArgumentError for bad
        digests or sizes, or ``base >= target``.
        """

    @abc.abstractmethod
    def patches(self, target: int | None = None) -> dict[tuple[int, int], dict[str, str]]:
        """Patch records: ``(base, target) -> {target object: patch object}``, of every version
        or of ``target`` only. A record goes when its base or its target version is removed."""

    @abc.abstractmethod
    def forget_objects(self, digests: set[str]) -> None:
        """Drop object records and the tensor-index entries that point into them, atomically."""

    # -- derived records ---------------------------------------------------------------------
    # What a recipe made of a source object (:mod:`paramstore.derived`): opaque bytes (JSON) under
    # ``<recipe>@<version>/<unit>``, shared by every host of the registry, so a host that needs a
    # derived form reads where another host put it (and fetches its objects) instead of deriving.
    @abc.abstractmethod
    def swap_derived(self, key: str, expected: bytes | None, record: bytes) -> bytes:
        """Set derived record ``key`` to ``record`` if it now holds ``expected`` (None: absent), in
        one transaction. Returns what ``key`` holds afterwards: ``record`` when the swap happened,
        else the current record, ``b""`` if none (the first writer of an absent key wins; a damaged
        record is replaced by passing it as ``expected``). InvalidArgumentError for a bad key or
        record."""

    @abc.abstractmethod
    def derived(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The derived records held under ``keys`` (absent keys are left out)."""

    @abc.abstractmethod
    def derived_keys(self) -> list[str]:
        """Every derived record's key, sorted (GC's mark reads them all)."""

    @abc.abstractmethod
    def drop_derived(self, keys: Iterable[str]) -> None:
        """Delete these derived records (absent keys are ignored)."""

    # -- peers -------------------------------------------------------------------------------
    @abc.abstractmethod
    def announce_peer(self, peer: Peer) -> None:
        """Register (or refresh) this process's peer as live. Objects it announced stay announced.

        The peer stays live until :meth:`withdraw_peer`, until this registry object is closed, or
        until its process dies (LMDB: ``peer.pid`` must be a process on this host; Redis: the
        announcing process renews it, see the implementation). Raises InvalidArgumentError for
        invalid fields.
        """

    @abc.abstractmethod
    def withdraw_peer(self, peer_id: str) -> None:
        """Remove a peer and everything it announced (no error if unknown).

        In a forked child, the peers its parent announced through this object are left alone.
        """

    @abc.abstractmethod
    def announce_objects(self, peer_id: str, objects: Mapping[str, int]) -> None:
        """The peer holds these objects (digest -> address in its registered memory).

        Announcing a digest again moves it to the new address. Raises InvalidArgumentError if the
        peer is not announced (or no longer live), or for a bad digest or address.
        """

    @abc.abstractmethod
    def announce_in_order(self, peer_id: str, key: str, address: int) -> int:
        """Announce ``key`` at ``address`` (as :meth:`announce_objects`) and, in the same atomic
        step, give it the next *position* among the holders of ``key``: one more than the largest
        position a holder of ``key`` still recorded has (0 for the first). Returns the position.

        Positions are the order of arrival every reader sees alike, whatever the hosts' clocks
        say: an :meth:`in_order` call that starts after one call returned finds that peer at a
        position smaller than any later call gets. Only positions above every recorded holder's
        are given out again, so while a peer holds position ``p``, every position below ``p``
        names the holder it was given to, or nobody. Announcing ``key`` again moves the peer to a
        new position; :meth:`announce_objects` of ``key`` takes its position away. (Relays place an object's fetchers in a tree by position,
        :func:`paramstore.relay.relay_order`.) Raises as :meth:`announce_objects` does.
        """

    @abc.abstractmethod
    def in_order(self, key: str, positions: Iterable[int]) -> tuple[int, dict[int, tuple[Peer, int]]]:
        """``(end, found)``: ``end``, the position the next :meth:`announce_in_order` of ``key``
        would give (0: nobody holds it); ``found``, for each of ``positions`` a live peer holds
        ``key`` at (:meth:`announce_in_order`), ``(peer, address)``.

        One consistent read (Redis: one round trip) whose work and reply grow with the positions
        asked, not with the holders of ``key``: a relay of hundreds of hosts asks for a dozen.
        Holders found dead are dropped (as :meth:`holders` does; ``end`` may still count one that
        this call found dead, or one not yet found dead). Raises InvalidArgumentError for a
        bad key or a position that is not an int in [0, 2**53).
        """

    @abc.abstractmethod
    def withdraw_objects(self, peer_id: str, digests: Iterable[str]) -> None:
        """The peer no longer serves these objects (no error for unknown peers or digests)."""

    @abc.abstractmethod
    def peers(self) -> list[Peer]:
        """Live peers, ordered by id. Records of dead peers are dropped here, with their objects."""

    @abc.abstractmethod
    def holders(self, digests: Iterable[str], limit: int | None = None) -> dict[str, list[tuple[Peer, int]]]:
        """For each digest some live peer announced: ``[(peer, address)]``, ordered by peer id.

        With ``limit`` (an int >= 1), at most that many per digest: a random sample where more
        hold it, drawn anew by each call, so that a reply and the work behind it (Redis:
        ``HRANDFIELD``) stay that small however many hosts hold the object; fewer where some of
        the sample are found dead. Digests nobody (live) holds are absent. One consistent read
        (Redis: one round trip).
        Removing versions or forgetting objects does not touch announcements: a peer withdraws
        what it no longer holds itself.
        """

    @abc.abstractmethod
    def watch(self, what: str = "versions") -> "Watch":
        """Start watching for changes. Arm it *before* reading the state.

        ``what``: ``"versions"`` (publish, prune, tags) or ``"leases"`` (a lease released or
        found dead; acquiring a lease wakes nobody).

        Use as ``with registry.watch() as w: while ...: read state; w.wait(timeout)``: a change
        made after ``watch()`` returned always wakes ``wait``. Must not busy-spin.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the registry's resources; withdraws the peers this object announced."""
