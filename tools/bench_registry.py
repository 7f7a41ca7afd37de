"""What one relay lookup costs the shared registry as the number of hosts grows.

A relay fetcher asks the registry who is ahead of it (docs/architecture.md, *Plan*). This starts a
redis-server on 127.0.0.1 (tests/redis_server.py) and, for each count of ``--hosts``, announces
that many peers fetching one object (each with its position, as :class:`paramstore.relay.Relay`
does: ``announce_in_order``), then has every one of them look up once, two ways, side by side:

* ``in_order``: what the relay asks now, the positions :func:`paramstore.relay.relay_order` names
  for it (its parent, its ancestors, the nearest ahead: at most ``RELAY_ASK``);
* ``holders``: what it asked until the lookup by position existed (session 17): ``holders`` of the
  object, its fetch key and a second per-fetcher key (the progress words, announced apart then),
  each listing every fetcher. The whole-object path (objects the manifest does not cover: patch
  objects) asked the same way for the object, its fetch key and its slices' keys;
* ``sampled``: what the whole-object path, lazy reads and the relay's whole holders ask now
  (:func:`paramstore.relay.holders_of`): one key, an object every fetcher holds, with a limit (a
  random sample);
* ``peers``: what a checkout asked before any peer fetch, whether there are peers at all (every
  live peer's record), against ``any``: whether anyone holds a missing object, ``holders(missing,
  limit=1)``, as it asks now.

Per lookup it reports the bytes redis-server sent (``INFO stats total_net_output_bytes``), the CPU
it spent (``INFO cpu``: it runs Lua on one thread, so this is what bounds a registry's lookups per
second), the client's wall time, and the entries the reply held. No link, no transfer: the
registry alone. Then what the one per-version read that still grows with the model costs: the
manifest (``get_manifest``) of a version laid out as Llama-2-70B.

    .venv/bin/python tools/bench_registry.py --json out/bench_registry.json --markdown out/bench_registry.md
    .venv/bin/python tools/docgen.py registry out/bench_registry.md --json out/bench_registry.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from typing import Any, Callable

import blake3
import redis

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import machine, write_outputs  # noqa: E402

from paramstore.backends.registries.base import ObjectInfo, Peer, TensorLocation  # noqa: E402
from paramstore.format import PIECE_SIZE, pieces, pieces_root  # noqa: E402
from paramstore.manifest import Manifest, TensorEntry, Version  # noqa: E402
from paramstore.options import DEFAULT_SHARD_SIZE_BYTES  # noqa: E402
from paramstore.backends.registries.redis import RedisRegistry  # noqa: E402
from paramstore.relay import BLOCK_BYTES, HOLDERS_SAMPLE, RELAY_ASK, _fetch_key, holders_of, relay_fanout, relay_order  # noqa: E402


def _server_cost(r: redis.Redis) -> tuple[int, float]:
    """(bytes redis-server sent, CPU seconds it used) so far."""
    cpu = r.info("cpu")
    return r.info("stats")["total_net_output_bytes"], cpu["used_cpu_user"] + cpu["used_cpu_sys"]


def measure(url: str, hosts: int, blocks: int, rounds: int) -> dict[str, Any]:
    """Announce ``hosts`` fetchers of one object of ``blocks`` blocks; time each lookup kind."""
    r = redis.Redis.from_url(url)
    reg = RedisRegistry(url, f"bench-{hosts}-{uuid.uuid4().hex[:8]}")
    try:
        digest = blake3.blake3(uuid.uuid4().bytes).hexdigest()
        fetch_key = _fetch_key(digest, None)
        words_key = blake3.blake3(fetch_key.encode()).hexdigest()  # a second key per fetcher, as before
        peers = [Peer(uuid.uuid4().hex, f"10.77.{i // 250}.{i % 250 + 2}:15012", f"host-{i}", os.getpid(), time.time())
                 for i in range(hosts)]
        t0 = time.perf_counter()
        for i, p in enumerate(peers):
            reg.announce_peer(p)
            assert reg.announce_in_order(p.id, fetch_key, 1 << 40 | i << 12) == i
            reg.announce_objects(p.id, {words_key: 1 << 40 | i << 12})  # the old layout's second key
        announce_s = (time.perf_counter() - t0) / hosts
        reg.announce_objects(peers[0].id, {digest: 1 << 41})  # the origin's whole object
        fanout = relay_fanout(hosts, blocks)
        kinds: dict[str, Callable[[int], int]] = {
            "in_order": lambda i: len(reg.in_order(fetch_key, relay_order(i, fanout))[1]),
            "holders": lambda i: sum(map(len, reg.holders([digest, fetch_key, words_key]).values())),
            # (every fetcher announced words_key: it stands for an object every host holds)
            "sampled": lambda i: sum(map(len, holders_of(reg, [words_key], peers[i].id).values())),
            "peers": lambda i: len(reg.peers()),
            "any": lambda i: len(reg.holders([digest], limit=1)),
        }
        out: dict[str, Any] = {"hosts": hosts, "fanout": fanout, "announce_s": announce_s}
        for name, lookup in kinds.items():
            per: list[tuple[float, float, float]] = []
            entries = 0
            for _ in range(rounds):
                b0, c0 = _server_cost(r)
                t0 = time.perf_counter()
                entries = sum(lookup(i) for i in range(hosts))
                wall = time.perf_counter() - t0
                b1, c1 = _server_cost(r)
                per.append(((b1 - b0) / hosts, (c1 - c0) / hosts, wall / hosts))
            out[name] = {"bytes": statistics.median(x[0] for x in per), "cpu_s": statistics.median(x[1] for x in per),
                         "wall_s": statistics.median(x[2] for x in per), "entries": entries / hosts}
        return out
    finally:
        reg.close()
        r.close()


def llama_70b() -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-2-70B checkpoint (723 tensors, 69B parameters)."""
    h, ffn, vocab, kv = 8192, 28672, 32000, 1024
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(80):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                (p + "mlp.down_proj.weight", (h, ffn)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def manifest_cost(url: str, rounds: int) -> dict[str, Any]:
    """Publish one version laid out as Llama-2-70B in bf16 (tensors packed into objects of the
    default shard size, a larger tensor in an object of its own, a piece digest per piece as a
    commit records them) and time reading its manifest back (``get_manifest``), as every host does
    at least once per version."""
    reg = RedisRegistry(url, f"bench-manifest-{uuid.uuid4().hex[:8]}")
    r = redis.Redis.from_url(url)
    try:
        entries, placement, objects = {}, {}, {}
        obj, used, held = None, 0, []

        def close_object() -> None:
            if obj is not None:
                objects[obj] = ObjectInfo(used, tuple(held))

        for name, shape in llama_70b():
            nbytes = 2 * math.prod(shape)
            if obj is None or used + nbytes > DEFAULT_SHARD_SIZE_BYTES:
                close_object()
                obj, used, held = blake3.blake3(uuid.uuid4().bytes).hexdigest(), 64, []
            npieces = len(pieces(nbytes)) if nbytes > PIECE_SIZE else 0
            piece_digests = tuple(blake3.blake3(f"{name}/{k}".encode()).hexdigest() for k in range(npieces))
            d = pieces_root(piece_digests, nbytes) if npieces else blake3.blake3(name.encode()).hexdigest()
            entries[name] = TensorEntry("bfloat16", shape, d, obj, used, nbytes, (), piece_digests)
            placement[d] = TensorLocation(obj, used, nbytes)
            held.append(d)
            used += nbytes
        close_object()
        manifest = Manifest(entries)
        version = Version(1, time.time(), manifest.nbytes, manifest.digest(), len(entries), (), {}, {})
        reg.publish(version, manifest, objects, placement)
        per = []
        for _ in range(rounds):
            b0, c0 = _server_cost(r)
            t0 = time.perf_counter()
            assert reg.get_manifest(1).nbytes == manifest.nbytes
            wall = time.perf_counter() - t0
            b1, c1 = _server_cost(r)
            per.append((b1 - b0, c1 - c0, wall))
        return {"tensors": len(entries), "objects": len(objects), "nbytes": manifest.nbytes,
                "largest_object": max(o.size for o in objects.values()),
                "pieces": sum(len(e.piece_digests) for e in entries.values()),
                "bytes": statistics.median(x[0] for x in per), "cpu_s": statistics.median(x[1] for x in per),
                "wall_s": statistics.median(x[2] for x in per)}
    finally:
        reg.close()
        r.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="8,64,512", help="fetcher counts, comma-separated")
    ap.add_argument("--mib", type=int, default=256, help="the object's size (its blocks set the fan-out)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every host looking up once; medians")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from redis_server import running

    res: dict[str, Any] = {"argv": ["tools/bench_registry.py", *sys.argv[1:]], "machine": machine()}
    blocks = max(1, (args.mib << 20) // BLOCK_BYTES)
    t0 = time.monotonic()
    with running() as url:
        rows = [measure(url, int(n), blocks, args.rounds) for n in args.hosts.split(",")]
        big = manifest_cost(url, max(3, args.rounds))
    res.update(rows=rows, blocks=blocks, manifest=big, total_seconds=time.monotonic() - t0)
    md = [f"One {args.mib} MiB object ({blocks} blocks), every fetcher looking up once per round, {args.rounds} rounds, "
          f"medians per lookup; redis-server {'on 127.0.0.1'}, `RELAY_ASK` = {RELAY_ASK}:", "",
          "| fetchers | fan-out | lookup | entries in the reply | bytes sent by redis | redis CPU | client wall |",
          "|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, label in (("in_order", "`in_order`: the relay, now"), ("holders", "`holders`, every holder: the relay before, the whole-object path before"),
                            ("sampled", f"`holders` of an object every host holds, limit {HOLDERS_SAMPLE + 1}: the whole-object path now"),
                            ("peers", "`peers()`: a checkout's check for sources, before"),
                            ("any", "`holders(missing, limit=1)`: that check now")):
            m = row[name]
            md.append(f"| {row['hosts']} | {row['fanout']} | {label} | {m['entries']:.1f} | {m['bytes'] / 1024:.1f} KiB | "
                      f"{m['cpu_s'] * 1e3:.3f} ms | {m['wall_s'] * 1e3:.3f} ms |")
    md += ["", "Announcing (`announce_peer`, `announce_in_order`, `announce_objects`) took "
           + ", ".join(f"{row['announce_s'] * 1e3:.2f} ms" for row in rows) + " per fetcher at "
           + ", ".join(str(row["hosts"]) for row in rows) + " fetchers."]
    md += ["", f"A manifest laid out as Llama-2-70B in bf16 ({big['tensors']} tensors, {big['nbytes'] / 2**30:.0f} GiB in "
           f"{big['objects']} objects: tensors packed into {DEFAULT_SHARD_SIZE_BYTES >> 20} MiB, a larger one alone, the "
           f"largest {big['largest_object'] / 2**20:.0f} MiB; {big['pieces']:,} piece digests): one `get_manifest`, as "
           f"every host makes at least once per version, had redis-server send {big['bytes'] / 2**20:.2f} MiB and "
           f"spend {big['cpu_s'] * 1e3:.1f} ms of CPU (client wall {big['wall_s'] * 1e3:.0f} ms; medians of "
           f"{max(3, args.rounds)})."]
    write_outputs(args.json, res, args.markdown, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
