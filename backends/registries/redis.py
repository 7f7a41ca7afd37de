"""A registry in Redis, shared by the hosts of a store (redis-py).

URL: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS). The password may be given in the
URL; messages show it masked. Every key starts with ``ps:{<namespace>}:``, so several stores share
one database (the braces are a Redis Cluster hash tag: a store's keys share one slot, as its scripts
need). Values are JSON, never pickle. A step is written as 20 zero-padded digits (``key(step)``)
in keys and values alike, so string order is step order for every 64-bit step:

=====================  ======  ==========================================================
key (after prefix)     type    content
=====================  ======  ==========================================================
``steps``              zset    every ``key(step)``, all with score 0 (ordered by ``ZRANGEBYLEX``)
``versions``           hash    key(step) -> the version record (``Version.to_json``)
``manifests``          hash    key(step) -> the manifest (``Manifest.to_json``; zlib-compressed
                               from :data:`MANIFEST_ZLIB_BYTES` on, :func:`pack_manifest`)
``refs``               hash    key(step) -> JSON list of the version's object digests
``persisted``          hash    key(step) -> URL of the remote the version is durable in
``tags``               hash    tag name -> key(step)
``tensors``            hash    tensor digest -> ``[object digest, offset, length]``
``patches``            hash    ``key(target):key(base)`` -> ``{target object: patch object}``
``objects``            hash    object digest -> ``{"size": n, "tensors": [digests]}``
``leases``             set     ids of leases that may be live
``lease:<id>``         string  ``{"step": key(step), "holder", "pid", "host", "acquired_at"}``, with a TTL
``peers``              set     ids of peers that may be live
``peer:<id>``          string  ``{"session", "host", "pid", "started_at"}``, with a TTL: live while it exists
``holders:<digest>``   hash    peer id -> address of the object in that peer's registered memory
``peer-objects:<id>``  set     the digests the peer announced (the reverse of ``holders:``)
``ranks:<key>``        zset    peer id, scored by its position among the holders of ``key``
                               (:meth:`~RedisRegistry.announce_in_order`)
=====================  ======  ==========================================================

Needs Redis 6.2 or later (``HRANDFIELD``, :meth:`~RedisRegistry.holders` with a limit). The
registry is as durable as the server is configured to be (``appendonly yes`` for a store that
must survive a Redis restart); object bytes never pass through it.

**Atomicity: Lua scripts, not WATCH/MULTI.** Every change that reads before it writes (publish's
step check, a tag or persisted mark on a version that must exist, a lease on a version that must
exist, a prune that must spare the latest and every leased version, forgetting objects with their
index entries) is one script. Redis runs a script atomically: no command of another client runs
between its check and its writes, so a prune and a lease acquisition on the same version are
serialized and exactly one of them wins. Optimistic WATCH would have to watch every lease key and
retry whenever a reader comes or goes; a busy fleet of readers could starve a prune. A script never
retries and costs one round trip. Scripts are sent by SHA (``EVALSHA``, ``EVAL`` once if the server
does not know them yet).

**Watch: pub/sub.** Scripts that change versions, tags or persisted marks ``PUBLISH`` on the
``events`` channel in the same atomic step; lease releases (and leases found expired) on
``lease-events``. ``watch()`` returns only once the server has confirmed the subscription, so a
change made after it returned is always heard. A lease watch also listens to the server's
``__keyevent@<db>__:expired`` channel, which wakes it when a lease expires *if* the server runs with
``notify-keyspace-events Ex`` (off by default: then expiry is noticed by whoever re-reads
``leases()``, as ``wait_for_readers`` does periodically).

**Leases: keys with a TTL** (``lease_ttl_s``, 10 s by default). Each registry object runs one daemon
heartbeat thread while it holds leases, extending their TTLs every ``lease_ttl_s / 3``; a process that
dies stops renewing and its leases expire with nobody's help. A lease lost anyway (the process stalled
longer than the TTL) is taken again if its version still exists, else reported with a warning.
Liveness is the TTL alone, so leases of other hosts count like local ones.

**Peers: a key with a TTL too** (``lease_ttl_s``), renewed by the same heartbeat while the registry
object that announced it is open and the peer is not withdrawn; ``close()`` withdraws it. Holdings
are one hash per object (``holders:<digest>``), so :meth:`~RedisRegistry.holders` is one script (one
round trip) whose work is the number of digests asked plus their holders, whatever the number of
peers; it lists a holder only while its ``peer:<id>`` key exists. Holdings carry no TTL: whoever
reads (``peers()``, ``holders()``) and finds a peer's key gone drops its holdings, through
``peer-objects:<id>``, in the same script. A peer lost anyway (its process stalled longer than the
TTL) is announced again, with every object announced through this registry object, and a warning.
So only the process that runs a peer should withdraw it: another process's withdrawal of a peer
whose owner is alive is undone by the owner's next heartbeat.

**Fork:** a child re-connects on first use (a connection pool must not cross a fork); the parent's
leases and peers are neither renewed (the heartbeat thread does not survive fork) nor released or
withdrawn by the child.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
import time
import warnings
import zlib
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.client import NEVER_DECODE

from paramstore import liveness
from paramstore.errors import (
    CorruptObjectError, InvalidArgumentError, ParamStoreError, ParamStoreWarning, RegistryError, StepOrderError,
    TagNotFoundError, VersionNotFoundError,
)
from paramstore.manifest import MAX_MANIFEST_BYTES, Manifest, Version, check_manifest
from paramstore.validate import check_digest

from .base import (
    Lease, ObjectInfo, Peer, Registry, TensorLocation, Watch, check_derived_key, check_derived_record, check_digests,
    check_holdings, check_limit, check_meta_key, check_patches, check_positions,
    check_peer, check_peer_id, unregistered,
)

__all__ = ["RedisRegistry", "mask_url", "from_url"]

DEFAULT_LEASE_TTL_S = 10.0
_MAX_STEP = 1 << 64


def _key(step: int) -> str:
    if not 0 <= step < _MAX_STEP:
        raise VersionNotFoundError(f"no version at step {step}")
    return f"{step:020d}"


def mask_url(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` query) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    return urlunsplit(parts._replace(query=re.sub(r"(^|&)(password=)[^&]*", r"\1\2***", parts.query)))


class _Script(NamedTuple):
    src: str
    sha: str


def _script(src: str) -> _Script:
    return _Script(src, hashlib.sha1(src.encode()).hexdigest())


# Live leases as a flat list {id, record, ...}; ids whose key expired are dropped from the set, and
# a drop is announced on the lease channel. Shared by the scripts that list and that prune.
_LIVE_LEASES = """
local function live_leases(set, prefix, channel)
  local out, dropped = {}, 0
  for _, id in ipairs(redis.call('smembers', set)) do
    local rec = redis.call('get', prefix .. id)
    if rec then out[#out + 1] = id; out[#out + 1] = rec
    else redis.call('srem', set, id); dropped = dropped + 1 end
  end
  if dropped > 0 then redis.call('publish', channel, 'expired') end
  return out
end
"""

# KEYS: steps versions manifests refs tags objects tensors
# ARGV: step, require_newest, version, manifest, refs, tags, objects, tensors (flat JSON lists), channel
# Returns nil, the step that stands in the way, or {objects referenced but not registered} (none of
# them among those this publish registers: another host's GC forgot them; nothing is written).
_PUBLISH = _script("""
local step = ARGV[1]
if ARGV[2] == '1' then
  local top = redis.call('zrange', KEYS[1], -1, -1)[1]
  if top and top >= step then return top end
elseif redis.call('zscore', KEYS[1], step) then
  return step
end
local objects = cjson.decode(ARGV[7])
local registering, missing = {}, {}
for i = 1, #objects, 2 do registering[objects[i]] = true end
for _, o in ipairs(cjson.decode(ARGV[5])) do
  if not registering[o] and redis.call('hexists', KEYS[6], o) == 0 then missing[#missing + 1] = o end
end
if #missing > 0 then return missing end
redis.call('zadd', KEYS[1], 0, step)
redis.call('hset', KEYS[2], step, ARGV[3])
redis.call('hset', KEYS[3], step, ARGV[4])
redis.call('hset', KEYS[4], step, ARGV[5])
for _, tag in ipairs(cjson.decode(ARGV[6])) do redis.call('hset', KEYS[5], tag, step) end
for i = 1, #objects, 2 do redis.call('hsetnx', KEYS[6], objects[i], objects[i + 1]) end
local tensors = cjson.decode(ARGV[8])
for i = 1, #tensors, 2 do redis.call('hset', KEYS[7], tensors[i], tensors[i + 1]) end
redis.call('publish', ARGV[9], step)
return false
""")

# KEYS: steps, a hash. ARGV: step, field, value, channel. Sets the field if the version exists.
_SET_IF_VERSION = _script("""
if not redis.call('zscore', KEYS[1], ARGV[1]) then return 0 end
redis.call('hset', KEYS[2], ARGV[2], ARGV[3])
redis.call('publish', ARGV[4], ARGV[1])
return 1
""")

# KEYS: tags. ARGV: name, channel. Returns the step the tag pointed at, or nil.
_DELETE_TAG = _script("""
local step = redis.call('hget', KEYS[1], ARGV[1])
if step then
  redis.call('hdel', KEYS[1], ARGV[1])
  redis.call('publish', ARGV[2], step)
end
return step
""")

# KEYS: steps, leases, lease:<id>. ARGV: step, id, record, ttl in ms. Returns 1, or 0 if the version is gone.
# Compare-and-set of one field of the store-level hash; returns what the field holds afterwards.
_SWAP_META = _script("""
local cur = redis.call('hget', KEYS[1], ARGV[1])
if ARGV[3] == '1' then
  if cur then return cur end
elseif cur ~= ARGV[2] then
  return cur
end
redis.call('hset', KEYS[1], ARGV[1], ARGV[4])
return ARGV[4]
""")

_ACQUIRE = _script("""
if not redis.call('zscore', KEYS[1], ARGV[1]) then return 0 end
redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[4])
redis.call('sadd', KEYS[2], ARGV[2])
return 1
""")

# KEYS: leases, lease:<id>. ARGV: id, channel.
_RELEASE = _script("""
redis.call('srem', KEYS[1], ARGV[1])
if redis.call('del', KEYS[2]) == 0 then return 0 end
redis.call('publish', ARGV[2], ARGV[1])
return 1
""")

# KEYS: leases. ARGV: lease key prefix, lease channel.
_LEASES = _script(_LIVE_LEASES + "return live_leases(KEYS[1], ARGV[1], ARGV[2])")

# KEYS: steps versions manifests refs persisted tags leases patches
# ARGV: lease key prefix, lease channel, events channel, steps... Returns the steps removed.
# Patch records whose base or target goes are dropped with them.
_REMOVE = _script(_LIVE_LEASES + """
local held = {}
local live = live_leases(KEYS[7], ARGV[1], ARGV[2])
for i = 2, #live, 2 do held[cjson.decode(live[i]).step] = true end
local latest = redis.call('zrange', KEYS[1], -1, -1)[1]
local removed, gone = {}, {}
for i = 4, #ARGV do
  local s = ARGV[i]
  if s ~= latest and not held[s] and redis.call('zrem', KEYS[1], s) == 1 then
    for k = 2, 5 do redis.call('hdel', KEYS[k], s) end
    removed[#removed + 1] = s
    gone[s] = true
  end
end
if #removed > 0 then
  local tags = redis.call('hgetall', KEYS[6])
  for i = 1, #tags, 2 do
    if gone[tags[i + 1]] then redis.call('hdel', KEYS[6], tags[i]) end
  end
  for _, pair in ipairs(redis.call('hkeys', KEYS[8])) do
    if gone[string.sub(pair, 1, 20)] or gone[string.sub(pair, 22, 41)] then redis.call('hdel', KEYS[8], pair) end
  end
  redis.call('publish', ARGV[3], 'removed')
end
return removed
""")

# KEYS: steps patches objects. ARGV: base, target, field, JSON {target object: patch object},
# JSON flat list [patch object, record, ...], events channel. Returns 0 when either version is gone, else 1.
_ADD_PATCHES = _script("""
if not redis.call('zscore', KEYS[1], ARGV[1]) or not redis.call('zscore', KEYS[1], ARGV[2]) then return 0 end
local pairs_ = {}
local cur = redis.call('hget', KEYS[2], ARGV[3])
if cur then pairs_ = cjson.decode(cur) end
for k, v in pairs(cjson.decode(ARGV[4])) do pairs_[k] = v end
redis.call('hset', KEYS[2], ARGV[3], cjson.encode(pairs_))
local objects = cjson.decode(ARGV[5])
for i = 1, #objects, 2 do redis.call('hsetnx', KEYS[3], objects[i], objects[i + 1]) end
redis.call('publish', ARGV[6], ARGV[2])
return 1
""")

# KEYS: objects, tensors. ARGV: object digests. Index entries that point elsewhere stay.
_FORGET = _script("""
for _, d in ipairs(ARGV) do
  local raw = redis.call('hget', KEYS[1], d)
  if raw then
    redis.call('hdel', KEYS[1], d)
    for _, t in ipairs(cjson.decode(raw).tensors) do
      local loc = redis.call('hget', KEYS[2], t)
      if loc and cjson.decode(loc)[1] == d then redis.call('hdel', KEYS[2], t) end
    end
  end
end
return 0
""")

# KEYS: steps versions tags. ARGV: lowest member (ZRANGEBYLEX syntax). One consistent read.
_VERSIONS = _script("""
local steps = redis.call('zrangebylex', KEYS[1], ARGV[1], '+')
local recs = {}
for i, s in ipairs(steps) do recs[i] = redis.call('hget', KEYS[2], s) end
return {steps, recs, redis.call('hgetall', KEYS[3])}
""")

# Peers. ARGV[1] is the key prefix ``ps:{ns}:`` (a peer's keys are named by its id and the digests).
# drop_peer deletes a peer and its holdings; shared by withdrawal and by readers that find it dead.
_DROP_PEER = """
local function drop_peer(p, id)
  local objs = p .. 'peer-objects:' .. id
  for _, d in ipairs(redis.call('smembers', objs)) do
    redis.call('hdel', p .. 'holders:' .. d, id)
    redis.call('zrem', p .. 'ranks:' .. d, id)
  end
  redis.call('del', objs, p .. 'peer:' .. id)
  redis.call('srem', p .. 'peers', id)
end
"""

# live(p, recs, id): the record of peer ``id`` if it is live, else false (a dead one is dropped),
# cached in ``recs``; records(recs): {id, record, ...} of the live peers in ``recs``. Shared by the
# scripts that look holders up.
_LIVE = _DROP_PEER + """
local function live(p, recs, id)
  if recs[id] == nil then
    recs[id] = redis.call('get', p .. 'peer:' .. id)
    if not recs[id] then drop_peer(p, id) end
  end
  return recs[id]
end
local function records(recs)
  local out = {}
  for id, rec in pairs(recs) do
    if rec then out[#out + 1] = id; out[#out + 1] = rec end
  end
  return out
end
"""

# rank_end(ranks) is one more than the largest position in the sorted set ``ranks`` (0: empty).
_RANK_END = """
local function rank_end(ranks)
  local last = redis.call('zrevrange', ranks, 0, 0, 'WITHSCORES')
  if #last > 0 then return tonumber(last[2]) + 1 end
  return 0
end
"""

# ARGV: prefix, id, record, ttl in ms, n, then n key, position pairs (the peer's positions, each
# taken back unless another peer holds it now), then digest, address pairs to announce with it.
_ANNOUNCE_PEER = _script("""
local p, id, n = ARGV[1], ARGV[2], tonumber(ARGV[5])
redis.call('set', p .. 'peer:' .. id, ARGV[3], 'PX', ARGV[4])
redis.call('sadd', p .. 'peers', id)
for i = 6, 5 + 2 * n, 2 do
  local ranks = p .. 'ranks:' .. ARGV[i]
  if redis.call('zcount', ranks, ARGV[i + 1], ARGV[i + 1]) == 0 then redis.call('zadd', ranks, ARGV[i + 1], id) end
end
for i = 6 + 2 * n, #ARGV, 2 do
  redis.call('hset', p .. 'holders:' .. ARGV[i], id, ARGV[i + 1])
  redis.call('sadd', p .. 'peer-objects:' .. id, ARGV[i])
end
return 1
""")

# ARGV: prefix, id, ordered key or "", then digest, address pairs (the ordered key's among them).
# Returns -1 if the peer is not live; else the ordered key's position (one more than the largest
# of its holders', 0 for the first), or 0 without one.
_ANNOUNCE_OBJECTS = _script(_RANK_END + """
local p, id, key = ARGV[1], ARGV[2], ARGV[3]
if redis.call('exists', p .. 'peer:' .. id) == 0 then return -1 end
local n = 0
if key ~= '' then
  n = rank_end(p .. 'ranks:' .. key)
  redis.call('zadd', p .. 'ranks:' .. key, n, id)
end
for i = 4, #ARGV, 2 do
  redis.call('hset', p .. 'holders:' .. ARGV[i], id, ARGV[i + 1])
  redis.call('sadd', p .. 'peer-objects:' .. id, ARGV[i])
  if ARGV[i] ~= key then redis.call('zrem', p .. 'ranks:' .. ARGV[i], id) end
end
return n
""")

# ARGV: prefix, id, digests...
_WITHDRAW_OBJECTS = _script("""
local p, id = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  redis.call('hdel', p .. 'holders:' .. ARGV[i], id)
  redis.call('zrem', p .. 'ranks:' .. ARGV[i], id)
  redis.call('srem', p .. 'peer-objects:' .. id, ARGV[i])
end
return 0
""")

# ARGV: prefix, id.
_WITHDRAW_PEER = _script(_DROP_PEER + "drop_peer(ARGV[1], ARGV[2]) return 0")

# ARGV: prefix. Returns {id, record, ...} of live peers; drops the dead.
_PEERS = _script(_DROP_PEER + """
local p, out = ARGV[1], {}
for _, id in ipairs(redis.call('smembers', p .. 'peers')) do
  local rec = redis.call('get', p .. 'peer:' .. id)
  if rec then out[#out + 1] = id; out[#out + 1] = rec else drop_peer(p, id) end
end
return out
""")

# ARGV: prefix, limit (0: none), digests... Returns {rows, peers}: rows[i] = {id, address, ...} of
# the i-th digest's live holders (a random sample of at most limit), peers = {id, record, ...} of
# those holders. Holders found dead are dropped.
_HOLDERS = _script(_LIVE + """
local p, limit, rows, recs = ARGV[1], tonumber(ARGV[2]), {}, {}
for i = 3, #ARGV do
  local key, held, row = p .. 'holders:' .. ARGV[i], nil, {}
  if limit > 0 then held = redis.call('hrandfield', key, limit, 'WITHVALUES') else held = redis.call('hgetall', key) end
  for j = 1, #held, 2 do
    if live(p, recs, held[j]) then row[#row + 1] = held[j]; row[#row + 1] = held[j + 1] end
  end
  rows[i - 2] = row
end
return {rows, records(recs)}
""")

# ARGV: prefix, key, positions... Returns {end, rows, peers}: end = one more than the largest
# position of the key's holders (0: none), rows = {position, id, address, ...} of live holders at
# the positions asked, peers = {id, record, ...} of those holders. Holders found dead are dropped.
_IN_ORDER = _script(_LIVE + _RANK_END + """
local p, key = ARGV[1], ARGV[2]
local ranks, held = p .. 'ranks:' .. key, p .. 'holders:' .. key
local rows, recs = {}, {}
for i = 3, #ARGV do
  for _, id in ipairs(redis.call('zrangebyscore', ranks, ARGV[i], ARGV[i])) do
    local a = live(p, recs, id) and redis.call('hget', held, id)
    if a then rows[#rows + 1] = tonumber(ARGV[i]); rows[#rows + 1] = id; rows[#rows + 1] = a end
  end
end
return {rank_end(ranks), rows, records(recs)}
""")


def _peer(peer_id: str, raw: str) -> Peer:
    def parse() -> Peer:
        r = json.loads(raw)
        return check_peer(Peer(peer_id, r["session"], r["host"], r["pid"], r["started_at"]))
    return _read(f"the announcement of peer {peer_id!r}", parse)


_T = TypeVar("_T")


def _read(what: str, parse: Callable[[], _T]) -> _T:
    """``parse()`` of something read back from Redis (other hosts wrote it): anything malformed
    in it raises CorruptObjectError naming ``what`` (never a bare ValueError or KeyError)."""
    try:
        return parse()
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, ParamStoreError) as e:
        raise CorruptObjectError(f"Redis registry: {what} is malformed: {e}") from None


#: A manifest's JSON of at least this many bytes is stored zlib-compressed (level 1). Most of a large
#: model's manifest is hex piece digests, which compress to ~57%: a Llama-2-70B manifest (65,780
#: piece digests) is 4.4 MB of JSON, 2.5 MB compressed in 50 ms, inflated in 17 ms by every host
#: that reads it (tools/bench_registry.py; docs/benchmarks.md, its block). A smaller one stays JSON.
MANIFEST_ZLIB_BYTES = 64 << 10


def pack_manifest(text: str) -> bytes:
    """What the registry stores for a manifest's JSON ``text``: the JSON itself, or from
    :data:`MANIFEST_ZLIB_BYTES` on its zlib stream (which never begins with ``{``, so a reader
    tells them apart: :func:`unpack_manifest`).

        >>> unpack_manifest(pack_manifest('{"a": 1}')) == '{"a": 1}'
        True
        >>> big = '{"d": "' + "0123456789abcdef" * 8192 + '"}'
        >>> packed = pack_manifest(big)
        >>> packed[:1] != b"{" and len(packed) < len(big) // 10 and unpack_manifest(packed) == big
        True
    """
    data = text.encode()
    return zlib.compress(data, 1) if len(data) >= MANIFEST_ZLIB_BYTES else data


def unpack_manifest(raw: bytes) -> str:
    """The manifest JSON :func:`pack_manifest` stored; ValueError for a stream that is not zlib or
    inflates beyond :data:`paramstore.manifest.MAX_MANIFEST_BYTES` (other hosts wrote it)."""
    if raw[:1] == b"{":
        return raw.decode()
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(raw, MAX_MANIFEST_BYTES)
    except zlib.error as e:
        raise ValueError(f"neither JSON nor a zlib stream ({e})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"it inflates beyond {MAX_MANIFEST_BYTES} bytes, or is cut short")
    return data.decode()


def _count(n: Any) -> int:
    """``n`` if it is an int >= 0 (not a bool), else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"expected an int >= 0, got {n!r}")
    return n


def _size(raw: str) -> int:
    """The size in an ``objects`` entry."""
    return _count(json.loads(raw)["size"])


def _address(digest: str, raw: Any) -> int:
    """An announced address of ``digest``: an int in [0, 2**64)."""
    def parse() -> int:
        a = int(raw)
        if not 0 <= a < 1 << 64:
            raise ValueError(f"address {a} out of range")
        return a
    return _read(f"an announced address of {digest}", parse)


def _patch_pairs(raw: str) -> dict[str, str]:
    pairs = json.loads(raw)
    if not isinstance(pairs, dict):
        raise ValueError("not an object")
    check_digests([*pairs, *pairs.values()])
    return pairs


def _refs(raw: str) -> list[str]:
    """A version's entry in ``refs``: the digests of its objects."""
    return check_digests(json.loads(raw))


def _lease(lease_id: str, raw: str) -> Lease:
    r = json.loads(raw)
    return Lease(lease_id, int(r["step"]), r["holder"], r["pid"], r["host"], r["acquired_at"])


def _location(raw: str) -> TensorLocation:
    """A tensor-index entry: ``[object digest, offset, nbytes]``."""
    obj, offset, nbytes = json.loads(raw)
    return TensorLocation(check_digest(obj), _count(offset), _count(nbytes))


def _pairs(flat: list[Any]) -> Iterator[tuple[Any, Any]]:
    return zip(flat[::2], flat[1::2])


# A child forked while another thread held a registry's lock would inherit it locked: re-connecting
# after fork replaces the per-object lock under this module lock, renewed in every child.
_FORK_LOCK = threading.Lock()


def _reinit_fork_lock() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reinit_fork_lock)

_F = TypeVar("_F", bound=Callable[..., Any])


def _translated(fn: _F) -> _F:
    """Raise redis-py's errors as RegistryError naming the (masked) URL."""

    @functools.wraps(fn)
    def wrapper(self: "RedisRegistry", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except redis.RedisError as e:
            raise RegistryError(f"Redis registry at {self.url}: {type(e).__name__}: {e}") from e

    return wrapper  # type: ignore[return-value]


def _tags_by_step(flat: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, step in zip(flat[::2], flat[1::2]):
        out.setdefault(step, []).append(name)
    return out


def _version(raw: str, tags: list[str]) -> Version:
    return _read("a version record", lambda: Version.from_json(json.loads(raw), tuple(sorted(tags))))


class _PubSubWatch(Watch):
    def __init__(self, client: redis.Redis, channels: list[str], url: str, timeout: float) -> None:
        self._url = url
        self._ps = client.pubsub()
        self._pending = False
        try:
            self._ps.subscribe(*channels)
            deadline = time.monotonic() + timeout
            confirmed = 0
            while confirmed < len(channels):  # armed only once the server has confirmed
                msg = self._ps.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if msg is None:
                    raise RegistryError(f"Redis registry at {url}: subscription not confirmed within {timeout} s")
                confirmed += msg["type"] == "subscribe"
                self._pending |= msg["type"] == "message"
        except BaseException as e:
            self._ps.close()
            if isinstance(e, redis.RedisError):
                raise RegistryError(f"Redis registry at {url}: cannot subscribe: {e}") from e
            raise

    def wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._pending:  # get_message blocks (select) until data or its timeout
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                msg = self._ps.get_message(timeout=left)
                self._pending = msg is not None and msg["type"] == "message"
            while self._ps.get_message(timeout=0.0) is not None:  # a burst of changes is one wake-up
                pass
        except redis.RedisError as e:
            raise RegistryError(f"Redis registry at {self._url}: watch failed: {e}") from e
        self._pending = False
        return True

    def close(self) -> None:
        self._ps.close()


class RedisRegistry(Registry):
    """Registry kept in a Redis database, under the key prefix ``ps:{<namespace>}:``.

    Args:
        url: ``redis://[:password@]host:port/db`` or ``rediss://...`` (TLS); the password may be
            in the URL (it is masked in messages).
        namespace: separates stores sharing a database (the store's ``name``, as ``ParamStore(name=)``); no braces.
        lease_ttl_s: a lease expires this long after its holder stopped renewing it.
        connect_timeout_s: how long to wait for the server when connecting.

    Raises:
        RegistryError: the server cannot be reached (or refuses the password).
        InvalidArgumentError: bad namespace or TTL.

    Example (needs a server; shown, not run)::

        reg = RedisRegistry("redis://:secret@10.0.0.5:6379/0", "run-42")
        reg.latest_step()
    """

    #: Shared by the hosts of a cluster: peers on other hosts hold objects it records.
    shared = True

    def __init__(self, url: str, namespace: str, *, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 connect_timeout_s: float = 5.0) -> None:
        if not namespace or any(c in namespace for c in "{}"):
            raise InvalidArgumentError(f"namespace must be a non-empty string without braces, got {namespace!r}")
        if not lease_ttl_s > 0:
            raise InvalidArgumentError(f"lease_ttl_s must be positive, got {lease_ttl_s!r}")
        self._url, self.url = url, mask_url(url)
        self._ttl_ms = max(1, int(lease_ttl_s * 1000))
        self._timeout = connect_timeout_s
        p = f"ps:{{{namespace}}}:"
        self._k = {n: p + n for n in ("steps", "versions", "manifests", "refs", "persisted", "tags",
                                      "tensors", "objects", "leases", "events", "lease-events", "meta",
                                      "patches", "derived")}
        self._lease_prefix = p + "lease:"
        self._prefix = p
        self._closed = False
        self._inherited: set[str] = set()  # a forked child's copy of its parent's leases
        self._inherited_peers: set[str] = set()  # ... and of its parent's peers
        self._connect()

    # -- connection --------------------------------------------------------------------------
    def _connect(self) -> None:
        try:
            r = redis.Redis.from_url(self._url, decode_responses=True, socket_keepalive=True,
                                     socket_connect_timeout=self._timeout)
            r.ping()
        except (redis.RedisError, ValueError) as e:
            raise RegistryError(f"cannot reach the Redis registry at {self.url}: {e}") from e
        self._r, self._db = r, r.connection_pool.connection_kwargs.get("db", 0)
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, str]] = {}  # lease id -> (step, record), renewed by _beat
        # peer id -> (record, {digest: address}, {key: position}) of the peers this object
        # announced, renewed by _beat (and announced again, positions included, after a lapse)
        self._peers: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {}
        self._beat: threading.Thread | None = None
        self._pid = os.getpid()

    def _client(self, *, closed_ok: bool = False) -> redis.Redis:
        if self._closed and not closed_ok:
            raise RuntimeError("registry is closed")
        if self._pid != os.getpid():
            with _FORK_LOCK:
                if self._pid != os.getpid():  # inherited across fork: a pool of this process's own
                    self._inherited |= set(self._held)  # (the parent's lock may be held: not taken)
                    self._inherited_peers |= set(self._peers)
                    self._connect()
        return self._r

    def _run(self, script: _Script, keys: list[str], args: list[Any], *, closed_ok: bool = False) -> Any:
        r = self._client(closed_ok=closed_ok)
        try:
            return r.evalsha(script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return r.eval(script.src, len(keys), *keys, *args)

    def _keys(self, *names: str) -> list[str]:
        return [self._k[n] for n in names]

    def close(self) -> None:
        """Withdraw this object's peers and disconnect; leases still held stay renewed until released
        (as a live process's would)."""
        self._closed = True
        if self._pid == os.getpid():
            with self._lock:
                mine = list(self._peers)
                self._peers.clear()  # no longer renewed, whatever happens below
            for peer_id in mine:
                try:
                    self._run(_WITHDRAW_PEER, [], [self._prefix, peer_id], closed_ok=True)
                except redis.RedisError as e:  # it expires within the TTL anyway
                    warnings.warn(f"Redis registry at {self.url}: could not withdraw peer {peer_id}: {e}",
                                  RuntimeWarning, stacklevel=2)
            self._shutdown_if_idle()

    def _shutdown_if_idle(self) -> None:
        with self._lock:
            idle = self._closed and not self._held
        if idle:
            self._r.connection_pool.disconnect()

    # -- reads -------------------------------------------------------------------------------
    # latest_step, get_version, tags, object_sizes and referenced_objects override the contract's
    # defaults only to be faster: one or two round trips instead of reading every version.
    @_translated
    def latest_step(self) -> int | None:
        top = self._client().zrange(self._k["steps"], -1, -1)
        return int(top[0]) if top else None

    @_translated
    def get_version(self, step: int) -> Version:
        key = _key(step)
        pipe = self._client().pipeline(transaction=True)  # MULTI/EXEC: one consistent read
        pipe.hget(self._k["versions"], key)
        pipe.hgetall(self._k["tags"])
        raw, tags = pipe.execute()
        if raw is None:
            raise VersionNotFoundError(f"no version at step {step}")
        return _version(raw, [name for name, s in tags.items() if s == key])

    @_translated
    def get_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, checked against its version's digest (other hosts wrote it):
        CorruptObjectError if it does not match. Raises VersionNotFoundError."""
        key = _key(step)
        # One round trip, not MULTI/EXEC: a transaction's replies are decoded as text together, and
        # a compressed manifest is bytes (NEVER_DECODE). A published version and its manifest never
        # change while the step exists; a mismatch (removed and published anew in between) is caught
        # by check_manifest below, never taken for the manifest.
        pipe = self._client().pipeline(transaction=False)
        pipe.hget(self._k["versions"], key)
        pipe.execute_command("HGET", self._k["manifests"], key, **{NEVER_DECODE: True})
        raw_version, raw = pipe.execute()
        if raw is None or raw_version is None:
            raise VersionNotFoundError(f"no version at step {step}")
        where = f"{self._k['manifests']} field {key} at {self.url}"
        manifest = _read(where, lambda: Manifest.parse(unpack_manifest(raw)))
        check_manifest(manifest, _version(raw_version, []), where=where)
        return manifest

    @_translated
    def versions(self, after: int | None = None) -> Iterator[Version]:
        if after is not None and after >= _MAX_STEP - 1:
            return iter([])
        low = "-" if after is None or after < 0 else "(" + _key(after)
        steps, recs, tags = self._run(_VERSIONS, self._keys("steps", "versions", "tags"), [low])
        by_step = _tags_by_step(tags)
        return iter([_version(raw, by_step.get(s, [])) for s, raw in zip(steps, recs)])

    @_translated
    def tags(self) -> dict[str, int]:
        return {name: int(s) for name, s in self._client().hgetall(self._k["tags"]).items()}

    @_translated
    def locate_tensors(self, digests: list[str]) -> dict[str, TensorLocation]:
        if not digests:
            return {}
        raws = self._client().hmget(self._k["tensors"], digests)
        return {d: _read(f"{self._k['tensors']} field {d!r}", functools.partial(_location, raw))
                for d, raw in zip(digests, raws) if raw is not None}

    @_translated
    def objects(self) -> dict[str, int]:
        """Every registered object and its size; CorruptObjectError for an entry whose digest is not
        64 lowercase hex digits (it could name a path: GC would unlink it) or whose size is bad."""
        what = self._k["objects"]
        return {_read(f"{what} field {d!r}", functools.partial(check_digest, d)):
                _read(f"{what} field {d!r}", functools.partial(_size, raw))
                for d, raw in self._client().hgetall(what).items()}

    @_translated
    def object_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        wanted = check_digests(digests)
        if not wanted:
            return {}
        raws = self._client().hmget(self._k["objects"], wanted)
        return {d: _read(f"{self._k['objects']} field {d!r}", functools.partial(_size, raw))
                for d, raw in zip(wanted, raws) if raw is not None}

    @_translated
    def referenced_objects(self) -> set[str]:
        out: set[str] = set()
        for raw in self._client().hvals(self._k["refs"]):
            out.update(_read(self._k["refs"], functools.partial(_refs, raw)))
        for pairs in self.patches().values():
            out.update(pairs.values())
        return out

    # -- patches -----------------------------------------------------------------------------
    @_translated
    def add_patches(self, base: int, target: int, patches: Mapping[str, tuple[str, int]]) -> bool:
        patches = check_patches(base, target, patches)
        pairs = {obj: patch for obj, (patch, _) in patches.items()}
        objects = [x for patch, size in patches.values() for x in (patch, json.dumps({"size": size, "tensors": []}))]
        args = [_key(base), _key(target), f"{_key(target)}:{_key(base)}", json.dumps(pairs), json.dumps(objects),
                self._k["events"]]
        return bool(self._run(_ADD_PATCHES, self._keys("steps", "patches", "objects"), args))

    @_translated
    def patches(self, target: int | None = None) -> dict[tuple[int, int], dict[str, str]]:
        out = {}
        for field, raw in self._client().hgetall(self._k["patches"]).items():
            t, _, b = field.partition(":")
            if target is not None and int(t) != target:
                continue
            out[(int(b), int(t))] = _read(f"{self._k['patches']} field {field!r}", functools.partial(_patch_pairs, raw))
        return out

    @_translated
    def persisted(self) -> dict[int, str]:
        return {int(s): url for s, url in self._client().hgetall(self._k["persisted"]).items()}

    # -- writes ------------------------------------------------------------------------------
    @_translated
    def publish(
        self,
        version: Version,
        manifest: Manifest,
        new_objects: dict[str, ObjectInfo],
        new_tensors: dict[str, TensorLocation],
        *,
        require_newest: bool = True,
    ) -> None:
        step = _key(version.step)
        objects = [x for d, info in new_objects.items()
                   for x in (d, json.dumps({"size": info.size, "tensors": list(info.tensors)}))]
        tensors = [x for d, loc in new_tensors.items() for x in (d, json.dumps(list(loc)))]
        keys = self._keys("steps", "versions", "manifests", "refs", "tags", "objects", "tensors")
        blocker = self._run(_PUBLISH, keys, [
            step, int(require_newest), json.dumps(version.to_json()), pack_manifest(json.dumps(manifest.to_json())),
            json.dumps(sorted(manifest.objects())), json.dumps(list(version.tags)), json.dumps(objects),
            json.dumps(tensors), self._k["events"],
        ])
        if blocker is None:
            return
        if isinstance(blocker, list):
            raise unregistered(version.step, blocker)
        if not require_newest:
            raise StepOrderError(f"step {version.step} already exists")
        raise StepOrderError(f"step {version.step} is not above the latest committed step {int(blocker)} "
                             "(another process committed it first)")

    def _set_if_version(self, step: int, hash_name: str, field: str, value: str) -> None:
        args = [_key(step), field, value, self._k["events"]]
        if not self._run(_SET_IF_VERSION, self._keys("steps", hash_name), args):
            raise VersionNotFoundError(f"no version at step {step}")

    @_translated
    def set_tag(self, name: str, step: int) -> None:
        self._set_if_version(step, "tags", name, _key(step))

    @_translated
    def delete_tag(self, name: str) -> int:
        step = self._run(_DELETE_TAG, self._keys("tags"), [name, self._k["events"]])
        if step is None:
            raise TagNotFoundError(f"no tag named {name!r}")
        return int(step)

    @_translated
    def set_persisted(self, step: int, remote: str) -> None:
        self._set_if_version(step, "persisted", _key(step), remote)

    # -- store-level values ------------------------------------------------------------------
    @_translated
    def get_meta(self, key: str) -> str | None:
        return self._client().hget(self._k["meta"], check_meta_key(key))

    @_translated
    def swap_meta(self, key: str, expected: str | None, value: str) -> str | None:
        out = self._run(_SWAP_META, self._keys("meta"),
                        [check_meta_key(key), expected or "", "1" if expected is None else "0", value])
        return out if isinstance(out, str) else None

    # -- derived records ---------------------------------------------------------------------
    @_translated
    def swap_derived(self, key: str, expected: bytes | None, record: bytes) -> bytes:
        record = check_derived_record(record)
        out = self._run(_SWAP_META, self._keys("derived"),
                        [check_derived_key(key), (expected or b"").decode("utf-8", "replace"),
                         "1" if expected is None else "0", record.decode()])
        return out.encode() if isinstance(out, str) else b""

    @_translated
    def derived(self, keys: Iterable[str]) -> dict[str, bytes]:
        wanted = [check_derived_key(k) for k in keys]
        if not wanted:
            return {}
        got = self._client().hmget(self._k["derived"], wanted)
        return {k: v.encode() for k, v in zip(wanted, got) if v is not None}

    @_translated
    def derived_keys(self) -> list[str]:
        return sorted(self._client().hkeys(self._k["derived"]))

    @_translated
    def drop_derived(self, keys: Iterable[str]) -> None:
        gone = [check_derived_key(k) for k in keys]
        if gone:
            self._client().hdel(self._k["derived"], *gone)

    @_translated
    def stores(self) -> dict[str, str | None]:
        """Every store in this database, by name (one ``SCAN``: for messages, not a hot path)."""
        client, out = self._client(), {}
        for key in client.scan_iter(match="ps:{*}:meta", count=1000):
            name = key[len("ps:{"):-len("}:meta")]
            out[name] = client.hget(key, "store_id")
        return dict(sorted(out.items()))

    # -- leases ------------------------------------------------------------------------------
    def _take(self, lease_id: str, step: int, record: str) -> bool:
        keys = [*self._keys("steps", "leases"), self._lease_prefix + lease_id]
        return bool(self._run(_ACQUIRE, keys, [_key(step), lease_id, record, self._ttl_ms], closed_ok=True))

    @_translated
    def acquire_lease(self, step: int, holder: str) -> Lease:
        self._client()
        lease = Lease(os.urandom(8).hex(), step, holder, os.getpid(), liveness.HOST, time.time())
        record = json.dumps({"step": _key(step), "holder": holder, "pid": lease.pid, "host": lease.host,
                             "acquired_at": lease.acquired_at})
        with self._lock:  # registered under the lock, so a release cannot slip in before _held knows it
            if not self._take(lease.id, step, record):
                raise VersionNotFoundError(f"no version at step {step} (pruned?)")
            self._held[lease.id] = (step, record)
            self._start_heartbeat()
        return lease

    def _start_heartbeat(self) -> None:
        """Start the heartbeat thread unless it runs (``self._lock`` held)."""
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="paramstore-registry-heartbeat", daemon=True)
            self._beat.start()

    @_translated
    def release_lease(self, lease_id: str) -> None:
        self._client(closed_ok=True)  # a snapshot may outlive its store: still release
        if lease_id in self._inherited:
            return  # a forked child: the lease is its parent's
        with self._lock:
            self._held.pop(lease_id, None)  # from now on the heartbeat cannot take it again
        self._run(_RELEASE, [self._k["leases"], self._lease_prefix + lease_id], [lease_id, self._k["lease-events"]],
                  closed_ok=True)
        self._shutdown_if_idle()

    @_translated
    def leases(self) -> list[Lease]:
        flat = self._run(_LEASES, self._keys("leases"), [self._lease_prefix, self._k["lease-events"]])
        out = []
        for lease_id, raw in zip(flat[::2], flat[1::2]):
            out.append(_read(f"lease {lease_id!r}", functools.partial(_lease, lease_id, raw)))
        return out

    def _heartbeat(self) -> None:
        """Extend this object's leases and peers every TTL/3; exits when it holds none (``acquire_lease``
        and ``announce_peer`` restart it)."""
        lock, held, peers = self._lock, self._held, self._peers
        warned = False
        while True:
            time.sleep(self._ttl_ms / 3000)
            with lock:
                mine, ours = list(held.items()), list(peers)
                if not mine and not ours:
                    self._beat = None
                    return
            try:
                pipe = self._r.pipeline(transaction=False)
                for lease_id, _ in mine:
                    pipe.pexpire(self._lease_prefix + lease_id, self._ttl_ms)
                for peer_id in ours:
                    pipe.pexpire(self._prefix + "peer:" + peer_id, self._ttl_ms)
                kept_all = pipe.execute()
                for (lease_id, (step, record)), kept in zip(mine, kept_all):
                    with lock:  # a lease released meanwhile is not in held: never taken again
                        if kept or lease_id not in held or self._take(lease_id, step, record):
                            continue
                        held.pop(lease_id)
                    warnings.warn(f"lease {lease_id} on step {step} expired (process stalled longer than "
                                  f"{self._ttl_ms / 1000} s?) and its version is gone", RuntimeWarning, stacklevel=1)
                for peer_id, kept in zip(ours, kept_all[len(mine):]):
                    with lock:  # a peer withdrawn meanwhile is not in peers: never announced again
                        if kept or peer_id not in peers:
                            continue
                        self._announce(peer_id, *peers[peer_id])
                    warnings.warn(f"peer {peer_id} expired (process stalled longer than {self._ttl_ms / 1000} s?) "
                                  "and was announced again", RuntimeWarning, stacklevel=1)
            except redis.RedisError as e:  # the next beat retries: a lease survives gaps up to 2/3 of its TTL
                if not warned:
                    warnings.warn(f"Redis registry at {self.url}: lease renewal failed: {e}", RuntimeWarning,
                                  stacklevel=1)
                    warned = True

    # -- peers -------------------------------------------------------------------------------
    def _announce(self, peer_id: str, record: str, objects: Mapping[str, int], ranks: Mapping[str, int]) -> None:
        args = [len(ranks), *(x for k, n in ranks.items() for x in (k, n)), *(x for d, a in objects.items() for x in (d, a))]
        self._run(_ANNOUNCE_PEER, [], [self._prefix, peer_id, record, self._ttl_ms, *args], closed_ok=True)

    @_translated
    def announce_peer(self, peer: Peer) -> None:
        check_peer(peer)
        self._client()
        record = json.dumps({"session": peer.session, "host": peer.host, "pid": peer.pid,
                             "started_at": peer.started_at})
        with self._lock:  # registered under the lock, so a withdrawal cannot slip in before _peers knows it
            self._inherited_peers.discard(peer.id)
            objects, ranks = self._peers[peer.id][1:] if peer.id in self._peers else ({}, {})
            self._announce(peer.id, record, objects, ranks)  # (what a lapse may have dropped comes back)
            self._peers[peer.id] = (record, objects, ranks)
            self._start_heartbeat()

    @_translated
    def withdraw_peer(self, peer_id: str) -> None:
        check_peer_id(peer_id)
        self._client()
        if peer_id in self._inherited_peers:
            return  # a forked child: the peer is its parent's
        with self._lock:
            self._peers.pop(peer_id, None)  # from now on the heartbeat cannot announce it again
        self._run(_WITHDRAW_PEER, [], [self._prefix, peer_id])

    @_translated
    def announce_objects(self, peer_id: str, objects: Mapping[str, int]) -> None:
        check_peer_id(peer_id)
        self._hold(peer_id, check_holdings(objects))

    @_translated
    def announce_in_order(self, peer_id: str, key: str, address: int) -> int:
        check_peer_id(peer_id)
        check_digests([key])
        return self._hold(peer_id, check_holdings({key: address}), key)

    def _hold(self, peer_id: str, objects: Mapping[str, int], key: str | None = None) -> int:
        """``peer_id`` holds ``objects`` (``key``, one of them, at the next position, returned;
        else 0). A peer of this object whose announcement lapsed (a stall) is announced again, whole."""
        self._client()
        args = [self._prefix, peer_id, key or "", *(x for d, a in objects.items() for x in (d, a))]
        with self._lock:
            mine = self._peers.get(peer_id)
            n = first = int(self._run(_ANNOUNCE_OBJECTS, [], args))
            if n < 0 and mine is not None:
                self._announce(peer_id, *mine)  # ours, and lapsed: announce it again, whole
                n = int(self._run(_ANNOUNCE_OBJECTS, [], args))
            if n < 0:
                raise InvalidArgumentError(f"peer {peer_id} is not announced (or its announcement expired)")
            if mine is not None:
                mine[1].update(objects)  # renewed with the peer from now on
                for d in objects:
                    mine[2].pop(d, None)
                if key is not None:
                    mine[2][key] = n
        if first < 0:  # it had lapsed
            warnings.warn(f"peer {peer_id} expired (process stalled longer than {self._ttl_ms / 1000} s?) and was "
                          "announced again", RuntimeWarning, stacklevel=3)
        return n

    @_translated
    def withdraw_objects(self, peer_id: str, digests: Iterable[str]) -> None:
        check_peer_id(peer_id)
        digests = check_digests(digests)
        self._client()
        with self._lock:  # first forgotten here, so the heartbeat cannot announce them again
            mine = self._peers.get(peer_id)
            for d in digests if mine is not None else ():
                mine[1].pop(d, None)
                mine[2].pop(d, None)
        if digests:
            self._run(_WITHDRAW_OBJECTS, [], [self._prefix, peer_id, *digests])

    @_translated
    def peers(self) -> list[Peer]:
        flat = self._run(_PEERS, [], [self._prefix])
        return sorted((_peer(peer_id, raw) for peer_id, raw in _pairs(flat)), key=lambda peer: peer.id)

    @_translated
    def holders(self, digests: Iterable[str], limit: int | None = None) -> dict[str, list[tuple[Peer, int]]]:
        digests = check_digests(digests)
        limit = check_limit(limit)
        if not digests:
            return {}
        rows, flat = self._run(_HOLDERS, [], [self._prefix, limit or 0, *digests])
        peers = {peer_id: _peer(peer_id, raw) for peer_id, raw in _pairs(flat)}
        out = {}
        for d, row in zip(digests, rows):
            if row:
                out[d] = sorted(((peers[peer_id], _address(d, a)) for peer_id, a in _pairs(row)),
                                key=lambda x: x[0].id)
        return out

    @_translated
    def in_order(self, key: str, positions: Iterable[int]) -> tuple[int, dict[int, tuple[Peer, int]]]:
        check_digests([key])
        positions = check_positions(positions)
        end, rows, flat = self._run(_IN_ORDER, [], [self._prefix, key, *positions])
        peers = {peer_id: _peer(peer_id, raw) for peer_id, raw in _pairs(flat)}
        found = {}
        for i in range(0, len(rows), 3):
            position, peer_id, address = rows[i:i + 3]
            found[_count(position)] = (peers[peer_id], _address(key, address))
        return _count(end), found

    # -- removal -----------------------------------------------------------------------------
    @_translated
    def remove_versions(self, steps: list[int]) -> list[int]:
        wanted = sorted({_key(s) for s in steps if 0 <= s < _MAX_STEP})
        if not wanted:
            return []
        keys = self._keys("steps", "versions", "manifests", "refs", "persisted", "tags", "leases", "patches")
        removed = self._run(_REMOVE, keys, [self._lease_prefix, self._k["lease-events"], self._k["events"], *wanted])
        return [int(s) for s in removed]

    @_translated
    def forget_objects(self, digests: set[str]) -> None:
        if digests:
            self._run(_FORGET, self._keys("objects", "tensors"), sorted(digests))

    @_translated
    def watch(self, what: str = "versions") -> Watch:
        if what == "versions":
            channels = [self._k["events"]]
        elif what == "leases":
            channels = [self._k["lease-events"], f"__keyevent@{self._db}__:expired"]
        else:
            raise ValueError(f"what must be 'versions' or 'leases', got {what!r}")
        return _PubSubWatch(self._client(), channels, self.url, self._timeout)


def from_url(url: str, meta_dir: str, namespace: str, *, create: bool = True, mode: int = 0o600) -> RedisRegistry:
    """The ``redis`` and ``rediss`` entry points (``paramstore.registries``): the store ``namespace``
    on the server at ``url`` (``meta_dir``, ``create`` and ``mode`` are unused: nothing is kept on
    this host). See :mod:`paramstore.backends.registries` for the signature.

    A URL without a password draws a ParamStoreWarning: whoever reaches the server could rewrite
    the store's metadata."""
    parts = urlsplit(url)
    if not parts.password and not parse_qs(parts.query).get("password"):
        warnings.warn(f"the registry URL {url} has no password: anyone who reaches the server can rewrite this "
                      "store's metadata (use redis://:PASSWORD@host:port/db and requirepass)",
                      ParamStoreWarning, stacklevel=4)
    return RedisRegistry(url, namespace)
