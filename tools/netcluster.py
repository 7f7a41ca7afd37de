"""A simulated cluster on one machine: N hosts, each a network namespace, joined by a switch.

Multi-host figures measured over loopback are CPU-bound (every "host" shares the same cores and a
memory-speed link). Here each host is a network namespace with its own interface and address,
linked by a veth pair to a bridge in a namespace of its own (the switch), and ``tc`` limits each
link's bandwidth (both directions, a token bucket: ``tbf``) and, where the kernel has ``netem``,
adds latency; so the network, not loopback, is what a transfer pays for. Needs root (``ip netns``).
(The kernel of the machines this was written on has no ``sch_netem``: there ``delay=`` raises,
and links have bandwidth limits only.)

Nothing touches the machine's own network: the switch and the hosts live in namespaces of their
own, with addresses in a private /24 and no route anywhere else, so their traffic can only reach
each other. Everything is removed on exit, also on an error, Ctrl-C or SIGTERM; names carry the
creating process's pid, so ``cleanup_stale()`` can remove what a killed run left.

Example (as root)::

    with Cluster(3, rate="1gbit") as c:
        server = c.popen(0, [sys.executable, "-m", "http.server", "8000"])
        c.run(2, ["curl", "-s", f"http://{c.address(0)}:8000/"])
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time
from typing import Any, Sequence

__all__ = ["Cluster", "available", "cleanup_stale"]

_SUBNET = "10.231.{net}.{host}"


def available() -> str | None:
    """None if namespaces can be made here, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"`{tool}` is not installed (Debian: iproute2)"
    name = f"psprobe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def cleanup_stale() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for line in out.splitlines():
        m = re.match(r"(psc(\d+)[a-z]\d*)\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True)
            gone.append(m.group(1))
    return gone


class Cluster:
    """``n`` hosts (namespaces ``psc<pid>h<i>``, addresses ``10.231.<k>.<i+1>``) on one switch.

    Args:
        n: number of hosts (1..200).
        rate: each link's bandwidth, each direction (a ``tc`` rate: ``"1gbit"``, ``"100mbit"``),
            or None for no limit.
        delay: one-way latency added on each host's uplink (``"1ms"``; needs ``netem``), or None.
        timeout: seconds after which the cluster tears itself down even if its user hangs
            (a SIGALRM in the creating process; None: no limit).
    """

    def __init__(self, n: int, *, rate: str | None = "1gbit", delay: str | None = None,
                 timeout: float | None = 600) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"a cluster has 1..200 hosts, got {n}")
        self.n, self.rate, self.delay, self.timeout = n, rate, delay, timeout
        self.tag = f"psc{os.getpid()}"
        self.net = os.getpid() % 250 + 1
        self._procs: list[subprocess.Popen] = []
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    # -- names ------------------------------------------------------------------------------------
    def namespace(self, i: int) -> str:
        """Host ``i``'s namespace name."""
        return f"{self.tag}h{i}"

    def address(self, i: int) -> str:
        """Host ``i``'s address (reachable from the other hosts only)."""
        return _SUBNET.format(net=self.net, host=i + 1)

    @property
    def switch(self) -> str:
        return f"{self.tag}s"

    # -- life cycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self._install_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _create(self) -> None:
        self._up = True
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns, port = self.namespace(i), f"p{i}"
            _ip("netns", "add", ns)
            # Made inside the host's namespace, then one end moved to the switch: the machine's own
            # namespace never sees either end.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            _ip("-n", ns, "link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, "eth0", self.delay)  # the host's uplink: its upload, with the latency
            self._shape(self.switch, port, None)  # the switch port towards it: its download

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        if delay:  # netem: latency, and the rate with it
            spec = ["delay", delay] + (["rate", self.rate] if self.rate else [])
            _run([*tc, "root", "netem", *spec, "limit", "100000"])
        elif self.rate:  # a token bucket holding 10 ms of the rate (at least 64 KiB)
            burst = max(64 << 10, _bits_per_s(self.rate) // 8 // 100)
            _run([*tc, "root", "tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"])

    def close(self) -> None:
        """Stop every process started in the cluster, then delete its namespaces (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                _kill_group(p)
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._up:
            for ns in [*(self.namespace(i) for i in range(self.n)), self.switch]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._up = False
        self._restore_handlers()

    def _install_handlers(self) -> None:
        atexit.register(self.close)

        def stop(signum: int, frame: Any) -> None:
            self.close()
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM) + ((signal.SIGALRM,) if self.timeout else ()):
            self._old_handlers[sig] = signal.signal(sig, stop)
        if self.timeout:
            signal.alarm(int(self.timeout) + 1)

    def _restore_handlers(self) -> None:
        if self.timeout and signal.SIGALRM in self._old_handlers:
            signal.alarm(0)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        atexit.unregister(self.close)

    # -- processes ----------------------------------------------------------------------------------
    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (in its namespace; its own process group, stopped at close)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], *, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``i`` to completion (output captured as text)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(i), *argv], capture_output=True, text=True,
                              timeout=timeout, **kwargs)


def _bits_per_s(rate: str) -> int:
    """``"100mbit"`` -> 100_000_000 (tc's decimal units)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(|k|m|g|t)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)])


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
