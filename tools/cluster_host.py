"""One host of a simulated cluster (tools/netcluster.py), and the driver's handles on a cluster of them.

**Host process** (``python tools/cluster_host.py --root DIR --address ADDR``, started by the driver
inside the host's network namespace): reads one JSON command per stdin line, answers one JSON
line on stdout. A host opens a paramstore (``open``: its own root under ``DIR``, the shared Redis
registry, ``store.serve(ADDR)``, so its own Mooncake transfer engine over TCP) and then, as the
trainer, ``commit``\\s a synthetic bf16 model (version 0 drawn from a seed; each later version the
previous one with a fraction of every tensor's elements changed, as in RL post-training), or, as
a rollout host, ``checkout``\\s versions. For baselines that bypass the store it also reads the
trainer's objects raw through the same transfer engine: ``star`` (the whole model from the
trainer) and ``chain`` (from its predecessor in a chain, slice by slice as they arrive there; a
small TCP side channel says how far the predecessor has got, as a chain broadcast does).

**Driver**: :func:`running_cluster` makes the namespaces (1 trainer + ``rollouts`` hosts, links
limited by ``tc``), starts redis-server in the trainer's namespace on the trainer's address, the
host processes, and yields a :class:`ClusterRun` with their handles; everything (processes,
namespaces, the ``/dev/shm`` roots) is removed on exit, also on an error, Ctrl-C, SIGTERM or the
cluster's ``timeout``. Needs root. A 3-host patch update, as a test would drive it::

    with running_cluster(2, rate="1gbit", mib=16, tensors=8, timeout=120) as run:
        run.open_all("t", patches=True)
        run.commit(0, seed=1)
        run.checkout_all(0)
        v1 = run.commit(1, seed=2, fraction=0.01, digests=True)
        replies = run.checkout_all(1, check=v1["tensor_digests"])
        assert all(r["ok"] and r["fetch"]["from_patches"] for r in replies)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_peers import Host, _raw_read

MiB = 1 << 20
REDIS_PORT = 6379
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
_NOTIFY = struct.Struct("!Q")  # chain side channel: bytes the sender holds, from offset 0
#: Environment variable: when set, each host logs the relay's decisions (logger ``paramstore.relay``
#: at DEBUG: who served each block, why an upstream was passed over) to its stderr.
LOG_ENV = "PARAMSTORE_CLUSTER_LOG"

__all__ = ["ClusterHost", "ClusterRun", "MiB", "model", "perturb", "running_cluster"]


# -- the synthetic model ----------------------------------------------------------------------------

def model(mib: float, tensors: int, seed: int) -> dict[str, Any]:
    """``tensors`` bf16 tensors of ~``mib``/``tensors`` MiB each (rows of 1024), N(0, 1) from ``seed``."""
    import torch

    per = max(2048, int(mib * MiB / tensors) // 2048 * 2048)  # bytes per tensor
    out = {}
    for i in range(tensors):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        out[f"layers.{i:03d}.weight"] = torch.randn(per // 2 // 1024, 1024, generator=g).to(torch.bfloat16)
    return out


def perturb(params: dict[str, Any], fraction: float, seed: int) -> int:
    """Change ``fraction`` of the elements of every tensor in place (their low mantissa bits XORed
    with a nonzero pattern; at least one element per tensor); returns the elements changed."""
    import torch

    changed = 0
    for i, t in enumerate(params.values()):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        bits = t.view(-1).view(torch.int16)
        mask = torch.rand(bits.numel(), generator=g) < fraction
        if not bool(mask.any()):
            mask[int(torch.randint(bits.numel(), (1,), generator=g))] = True
        idx = mask.nonzero().view(-1)
        bits[idx] ^= torch.randint(1, 128, (idx.numel(),), generator=g, dtype=torch.int16)
        changed += idx.numel()
    return changed


def _digests(params: Any) -> dict[str, str]:
    import blake3
    import torch

    return {k: blake3.blake3(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() for k, v in params.items()}


# -- the host process ---------------------------------------------------------------------------------

class _RawBuffer:
    """A pre-faulted anonymous destination registered with the host's transfer engine, and the
    side channel telling a chain successor how many of its bytes (from offset 0) have arrived."""

    def __init__(self, transport: Any, total: int, address: str) -> None:
        import numpy as np

        self.transport, self.total = transport, total
        self.mem = mmap.mmap(-1, total)
        np.frombuffer(self.mem, np.uint8)[:] = 1  # fault every page in before any timing
        self.addr = transport.register(self.mem)
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        self._cv = threading.Condition()
        self._held = 0  # bytes from 0 that have arrived here
        self._conn: socket.socket | None = None

    def serve_successor(self, timeout: float) -> None:
        """Accept the successor's connection (in a thread) and keep it told how far we are."""
        def run() -> None:
            self.listener.settimeout(timeout)
            with contextlib.suppress(OSError):
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sent = -1
                while True:
                    with self._cv:
                        self._cv.wait_for(lambda sent=sent: self._held != sent, timeout)
                        now = self._held
                    if now == sent:
                        return  # nothing new within the timeout
                    conn.sendall(_NOTIFY.pack(now))
                    sent = now
                    if now >= self.total:
                        conn.close()
                        return
        threading.Thread(target=run, daemon=True).start()

    def arrived(self, held: int) -> None:
        with self._cv:
            self._held = held
            self._cv.notify_all()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.transport.unregister(self.addr)
        self.listener.close()
        with contextlib.suppress(BufferError):
            self.mem.close()


class _Upstream:
    """How many bytes the predecessor holds: everything (the trainer), or what its side channel says."""

    def __init__(self, total: int, notify: Sequence[Any] | None, timeout: float) -> None:
        self.total, self.cv = total, threading.Condition()
        self.held = total if notify is None else 0
        if notify is not None:
            sock = socket.create_connection((notify[0], int(notify[1])), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._listen, args=(sock,), daemon=True).start()

    def _listen(self, sock: socket.socket) -> None:
        buf = b""
        with sock, contextlib.suppress(OSError):
            while True:
                data = sock.recv(4096)
                if not data:
                    return
                buf += data
                n = len(buf) // _NOTIFY.size
                if n:
                    held = _NOTIFY.unpack_from(buf, (n - 1) * _NOTIFY.size)[0]
                    buf = buf[n * _NOTIFY.size:]
                    with self.cv:
                        self.held = held
                        self.cv.notify_all()


def _chain_read(engine: Any, peer: str, segments: Sequence[Sequence[int]], buf: _RawBuffer, up: _Upstream,
                slice_bytes: int, window: int, deadline: float) -> None:
    """Read ``segments`` (``[offset, remote address, bytes]``, in offset order, covering the buffer)
    from ``peer`` into ``buf``, slice by slice, each only once ``up`` says the peer holds it, at most
    ``window`` in flight; after each slice, tell the successor how many bytes from 0 are here."""
    slices = [(off + o, remote + o, min(slice_bytes, n - o)) for off, remote, n in segments for o in range(0, n, slice_bytes)]
    done = [False] * len(slices)
    nxt = prefix = 0
    pending: dict[int, int] = {}  # batch -> slice index
    while prefix < len(slices):
        with up.cv:
            held = up.held
        while nxt < len(slices) and len(pending) < window and slices[nxt][0] + slices[nxt][2] <= held:
            off, remote, n = slices[nxt]
            b = engine.batch_transfer_async_read(peer, [buf.addr + off], [remote], [n])
            if not b:
                raise RuntimeError(f"{peer} refused a read")
            pending[b] = nxt
            nxt += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"chain read: {prefix}/{len(slices)} slices after the deadline")
        if not pending:
            with up.cv:
                up.cv.wait_for(lambda held=held: up.held > held, 0.05)
            continue
        progressed = False
        for b, i in list(pending.items()):
            rc = engine.transfer_check_status(b)
            if rc == 0:
                continue
            if rc != 1:
                raise RuntimeError(f"chain read of slice {i} from {peer} failed: code {rc}")
            del pending[b]
            done[i] = progressed = True
        if progressed:
            while prefix < len(slices) and done[prefix]:
                prefix += 1
            buf.arrived(slices[prefix - 1][0] + slices[prefix - 1][2] if prefix else 0)
        else:
            time.sleep(0.0005)


def host_main(root: str, address: str) -> None:
    """The host process: a JSON command per stdin line, a JSON answer per stdout line."""
    import torch

    import paramstore
    from paramstore import ParamStore

    torch.set_num_threads(1)  # 2 cores for every "host": no thread pools fighting over them
    store: Any = None
    server: Any = None
    params: dict[str, Any] | None = None
    raw: _RawBuffer | None = None
    store_root = ""

    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    def sync() -> None:
        for _ in range(100):  # PeerServer.sync may race with its own rescan thread (KeyError)
            try:
                server.sync()
                return
            except KeyError:
                time.sleep(0.02)

    def close_store(settle: float = 0.0) -> None:
        """Close the open store (and the raw baselines' buffer) and delete its root; ``settle``:
        then wait up to that many seconds for the process's pending retirements (memory a relay
        keeps registered and mapped ~20 s after a fetch, for hosts that may still read it), so
        that unmapping and freeing the old store's pages is not timed with the next one's work
        (8 hosts at 1 Gbit/s, four stores one after the other, without it: 2.79, 3.24, 4.77 and
        3.28 s for the same fresh version)."""
        from paramstore import retire

        if raw is not None:
            raw.close()
        store.close()
        shutil.rmtree(store_root, ignore_errors=True)
        deadline = time.monotonic() + settle
        while retire._retirements._due and time.monotonic() < deadline:
            time.sleep(0.1)

    say(ready=True, pid=os.getpid(), version=getattr(paramstore, "__version__", "?"))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                break
            elif op == "open":  # the store this host had open is closed first: one store, one engine per host
                if store is not None:
                    close_store(settle=60.0)
                    store = server = params = raw = None
                store_root = os.path.join(root, cmd["name"])
                kw: dict[str, Any] = {}
                if cmd.get("patches") is not None:
                    kw["patches"] = cmd["patches"]
                if cmd.get("shard_mib"):
                    kw["shard_size_bytes"] = int(cmd["shard_mib"] * MiB)
                store = ParamStore(store_root, registry=cmd["registry"], name=cmd["name"], pin_memory=False,
                                   prepare_buffers=cmd.get("role") != "trainer", **kw)
                server = store.serve(address)
                say(session=server.peer.session)
            elif op == "close":
                close_store()
                store = server = params = raw = None
                say(closed=True)
            elif op == "commit":  # trainer: version 0 from a seed, or the last version perturbed
                t0 = time.perf_counter()
                if params is None or cmd.get("fraction") is None:
                    params = model(cmd["mib"], cmd["tensors"], cmd["seed"])
                    changed = sum(t.numel() for t in params.values())
                else:
                    changed = perturb(params, cmd["fraction"], cmd["seed"])
                t1 = time.perf_counter()
                store.commit(cmd["step"], params).result()
                t2 = time.perf_counter()
                store.flush(timeout=600)  # with patches: they are made too
                t3 = time.perf_counter()
                sync()  # announce now, not at the next rescan
                reg = store._root.registry
                sizes = reg.objects()
                served = dict(server._served)
                patcher = getattr(store, "_patcher", None)
                last = getattr(patcher, "last", None)
                objs = [[d, served[d][1], sizes[d]] for d in reg.get_manifest(cmd["step"]).objects()]
                say(step=cmd["step"], make_s=t1 - t0, commit_s=t2 - t1, patch_s=t3 - t2, objects=objs,
                    model_bytes=sum(t.numel() * t.element_size() for t in params.values()),
                    elements=sum(t.numel() for t in params.values()), changed=changed,
                    patch_bytes=last.bytes if last is not None and last.target == cmd["step"] else None,
                    tensor_digests=_digests(params) if cmd.get("digests") else None)
            elif op == "settle":  # let background work of the last fetch finish (a host's idle time)
                t0 = time.perf_counter()
                pool = store._pool
                ready = pool.wait_prepared(cmd.get("wait", 30))
                kicked = False
                if not ready and cmd.get("kick") and pool._want.get("fetch"):
                    # experiment: wake the fill thread (SlabPool.take does not; prepare() does)
                    pool.prepare(list(pool._want["fetch"]), purpose="fetch")
                    ready, kicked = pool.wait_prepared(cmd.get("wait", 30)), True
                diag = None if ready else {  # why the slab pool is not ready (store-side state, for a bug report)
                    "want": {k: len(v) for k, v in pool._want.items()}, "missing": len(pool._missing()),
                    "free": {str(k): len(v) for k, v in pool._free.items()}, "stalled": pool._stalled,
                    "error": repr(pool._fill_error), "grace_s": pool._grace_until - time.monotonic(),
                    "thread_alive": pool._thread is not None and pool._thread.is_alive(), "busy": pool._busy,
                    "recycled": len(pool._recycled)}
                say(settled=ready, waited_s=time.perf_counter() - t0, pool=diag, kicked=kicked)
            elif op == "checkout":
                w0, t0 = time.time(), time.perf_counter()
                snap = store.checkout(cmd["step"])
                t1 = time.perf_counter()
                ok = None
                if cmd.get("check"):
                    ok = _digests(snap) == cmd["check"]
                snap.close()
                say(s=t1 - t0, start=w0, end=w0 + (t1 - t0), fetch=snap.fetch.as_dict(), ok=ok)
            elif op == "raw_prepare":  # a registered destination + the chain side channel
                if raw is not None:
                    raw.close()
                raw = _RawBuffer(store._read.get_transport(), cmd["total"], address)
                say(addr=raw.addr, port=raw.port)
            elif op == "raw_warm":  # connect to the peer's engine before timing (one 4 KiB read)
                store._read.get_transport().read(cmd["peer"], [(raw.addr, cmd["remote"], 4096)])
                say(warm=True)
            elif op in ("star", "chain"):
                engine = store._read.get_transport()._engine
                deadline = time.monotonic() + cmd.get("timeout", 300)
                up = _Upstream(raw.total, cmd.get("notify") if op == "chain" else None, cmd.get("timeout", 300))
                if cmd.get("successor"):
                    raw.serve_successor(cmd.get("timeout", 300))
                w0, t0 = time.time(), time.perf_counter()
                if op == "star":
                    _raw_read(engine, cmd["peer"], [(raw.addr + off, remote, n) for off, remote, n in cmd["segments"]],
                              cmd["slice"], cmd["window"])
                    raw.arrived(raw.total)
                else:
                    _chain_read(engine, cmd["peer"], cmd["segments"], raw, up, cmd["slice"], cmd["window"], deadline)
                t1 = time.perf_counter()
                say(s=t1 - t0, start=w0, end=w0 + (t1 - t0))
            elif op == "raw_check":  # the raw buffer holds the trainer's objects, in order
                import numpy as np

                got, ok = np.frombuffer(raw.mem, np.uint8), True
                for (d, _, n), (off, _, _) in zip(cmd["objects"], cmd["segments"]):
                    with open(store._root.tier.object_path(d), "rb") as f:
                        ok = ok and bool(np.array_equal(got[off:off + n], np.fromfile(f, np.uint8)))
                del got
                say(ok=ok)
            elif op == "raw_free":
                if raw is not None:
                    raw.close()
                    raw = None
                say(freed=True)
            else:
                say(error=f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
            say(error=f"{type(e).__name__}: {e}")
    if store is not None:
        with contextlib.suppress(Exception):
            store.close()
        shutil.rmtree(store_root, ignore_errors=True)


# -- the driver's side --------------------------------------------------------------------------------

class HostError(RuntimeError):
    """A host answered a command with an error."""


class ClusterHost(Host):
    """A host process in a namespace of the cluster (``send``/``expect``/``ask`` from bench_peers.Host)."""

    def __init__(self, cluster: Any, index: int, role: str, root: str) -> None:
        env = dict(os.environ, MC_FORCE_TCP="1", PARAMSTORE_HOST=cluster.address(index), PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.role, self.index, self.address, self.session = role, index, cluster.address(index), ""
        self.proc = cluster.popen(index, [sys.executable, os.path.abspath(__file__), "--root", root,
                                          "--address", self.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def expect(self, timeout: float = 300) -> dict[str, Any]:
        rep = super().expect(timeout)
        if "error" in rep:
            raise HostError(f"{self.role} host {self.index}: {rep['error']}")
        return rep

    def ask(self, op: str, timeout: float = 300, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.expect(timeout)


class ClusterRun:
    """Handles on a running cluster: ``cluster`` (netcluster.Cluster), ``registry`` (the Redis URL),
    ``trainer`` and ``rollouts`` (:class:`ClusterHost`), and the model's shape (``mib``, ``tensors``)."""

    def __init__(self, cluster: Any, registry: str, trainer: ClusterHost, rollouts: list[ClusterHost],
                 redis: subprocess.Popen, mib: float, tensors: int, registry_index: int | None = None) -> None:
        self.cluster, self.registry, self.trainer, self.rollouts = cluster, registry, trainer, rollouts
        self.redis, self.mib, self.tensors, self.registry_index = redis, mib, tensors, registry_index

    @property
    def hosts(self) -> list[ClusterHost]:
        return [self.trainer, *self.rollouts]

    def all(self, hosts: Sequence[ClusterHost], op: str, timeout: float = 300, **kw: Any) -> list[dict[str, Any]]:
        """Send ``op`` to every host of ``hosts`` at once; their answers, in order."""
        for h in hosts:
            h.send(op, **kw)
        return [h.expect(timeout) for h in hosts]

    def open_all(self, name: str, *, patches: bool | None = None, shard_mib: float | None = None) -> None:
        """Every host opens (and serves) a store ``name`` of the shared registry."""
        for h in self.hosts:
            h.send("open", name=name, registry=self.registry, patches=patches, shard_mib=shard_mib, role=h.role)
        for h in self.hosts:
            h.session = h.expect(120)["session"]

    def close_all(self) -> None:
        """Every host closes its store and deletes its root."""
        self.all(self.hosts, "close", 120)

    def commit(self, step: int, seed: int, fraction: float | None = None, *, digests: bool = False,
               timeout: float = 600) -> dict[str, Any]:
        """The trainer commits version ``step`` (``fraction`` None: drawn afresh) and its patches."""
        return self.trainer.ask("commit", timeout, step=step, seed=seed, fraction=fraction, mib=self.mib,
                                tensors=self.tensors, digests=digests)

    def checkout_all(self, step: int, hosts: Sequence[ClusterHost] | None = None, *, check: Any = None,
                     timeout: float = 300, settle: float = 10, kick: bool = False) -> list[dict[str, Any]]:
        """``hosts`` (default: every rollout) check ``step`` out at once; each answer gets ``done_s``:
        seconds from the moment the driver sent the first command to that host's end, and
        ``settled``: whether the store's slab pool had prepared what it wanted first (waited for up
        to ``settle`` s, as a host's idle time between versions; ``pool``: its state if not;
        ``kick``: if not, call ``prepare`` again and wait once more, an experiment)."""
        hosts = self.rollouts if hosts is None else list(hosts)
        settled = self.settle_all(hosts, settle, kick=kick) if settle else [None] * len(hosts)
        t0 = time.time()
        reps = self.all(hosts, "checkout", timeout, step=step, check=check)
        for r, s in zip(reps, settled):
            r["done_s"] = r["end"] - t0
            if s is not None:
                r["settled"] = s
        return reps

    def settle_all(self, hosts: Sequence[ClusterHost] | None = None, wait: float = 10, *,
                   kick: bool = False) -> list[dict[str, Any]]:
        """Each host waits (up to ``wait`` s) for its store's slab pool to be ready (see :meth:`checkout_all`)."""
        return self.all(self.rollouts if hosts is None else hosts, "settle", 2 * wait + 30, wait=wait, kick=kick)

    def counters(self) -> list[dict[str, int]]:
        """Each host's eth0 byte counters (read inside its namespace): ``tx`` and ``rx``."""
        return [self._counters(i) for i in range(len(self.hosts))]

    def registry_counters(self) -> dict[str, int] | None:
        """The registry host's eth0 counters, where redis-server runs on a host of its own (else None)."""
        return None if self.registry_index is None else self._counters(self.registry_index)

    def _counters(self, i: int) -> dict[str, int]:
        r = self.cluster.run(i, ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                                 "/sys/class/net/eth0/statistics/rx_bytes"], timeout=10)
        tx, rx = (int(x) for x in r.stdout.split())
        return {"tx": tx, "rx": rx}

    def pids(self) -> list[int]:
        """Every process of the run: the hosts and redis-server."""
        return [h.proc.pid for h in self.hosts] + [self.redis.pid]


def _wait_redis(proc: subprocess.Popen, timeout: float) -> None:
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Ready to accept connections" in line:
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not lines or "Ready to accept" not in lines[-1]:
        raise RuntimeError(f"redis-server did not start within {timeout} s: {''.join(lines[-5:])}")


def _quit(hosts: Sequence[ClusterHost]) -> None:
    """Ask every host to quit (closing its store, deleting its root) at once; kill the ones that do not."""
    for h in hosts:
        with contextlib.suppress(Exception):
            if h.proc.poll() is None:
                h.send("quit")
    for h in hosts:
        try:
            h.proc.wait(20)
        except subprocess.TimeoutExpired:
            h.proc.kill()
            h.proc.wait()


@contextlib.contextmanager
def running_cluster(rollouts: int = 3, *, rate: str | None = "1gbit", mib: float = 16, tensors: int = 8,
                    timeout: float = 600, base: str | None = None, registry_host: bool = False) -> Iterator[ClusterRun]:
    """A cluster of 1 trainer + ``rollouts`` hosts with redis and a host process on each (see the
    module's docstring); ``timeout``: the cluster tears itself down after that many seconds.
    ``base``: where the hosts' roots go (default: a new directory in /dev/shm, deleted at the end).
    ``registry_host``: redis-server on a host of its own (the last namespace, with its own link),
    not in the trainer's namespace, so that the trainer's link carries no registry replies."""
    import netcluster

    netcluster.cleanup_stale()
    made = base is None
    base = base or tempfile.mkdtemp(prefix="ps-cluster-", dir="/dev/shm")
    hosts: list[ClusterHost] = []
    try:
        with netcluster.Cluster(rollouts + 1 + registry_host, rate=rate, timeout=timeout) as c:
            password = secrets.token_hex(8)
            os.makedirs(os.path.join(base, "redis"), exist_ok=True)
            at = rollouts + 1 if registry_host else 0
            redis = c.popen(at, [REDIS, "--bind", c.address(at), "--port", str(REDIS_PORT), "--save", "",
                                 "--appendonly", "no", "--dir", os.path.join(base, "redis"),
                                 "--requirepass", password], stdout=subprocess.PIPE, text=True)
            _wait_redis(redis, 20)
            url = f"redis://:{password}@{c.address(at)}:{REDIS_PORT}/0"
            for i in range(rollouts + 1):
                hosts.append(ClusterHost(c, i, "trainer" if i == 0 else "rollout", os.path.join(base, f"host{i}")))
            for h in hosts:
                h.expect(120)
            try:
                yield ClusterRun(c, url, hosts[0], hosts[1:], redis, mib, tensors, at if registry_host else None)
            finally:
                _quit(hosts)
    finally:
        if made:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one host of tools/bench_cluster.py (started by its driver)")
    p.add_argument("--root", required=True)
    p.add_argument("--address", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("PARAMSTORE_HOST", a.address)
    if os.environ.get(LOG_ENV):  # the relay's decisions, one line each, to this host's stderr
        import logging

        logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                            format=f"%(created).3f {a.address} %(name)s %(message)s")
        logging.getLogger("paramstore.relay").setLevel(logging.DEBUG)
    host_main(a.root, a.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
