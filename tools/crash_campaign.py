"""SIGKILL campaign: kill trainers, pruners, readers, uploads and fetches at random moments, then
check that no version was torn or lost, that the next trainer resumes, and that GC leaves nothing.

Run (about 10 minutes on 2 cores)::

    .venv/bin/python tools/crash_campaign.py --kills 300 --json out/crash_campaign.json \\
        --markdown out/crash_campaign.md

Scenarios (``--scenarios``, all by default; ``--kills`` is spread over them):

* ``commit``: a trainer commits in a loop (two commits in flight) and is killed.
* ``retention``: the same with ``retention=KeepLast(2)``: prune + GC (and buffer recycling) run in
  the trainer's background when it is killed.
* ``prune-gc``: another process runs ``prune(KeepLast(2))`` + ``gc()`` in a loop while a trainer
  commits; the pruner is killed, the trainer a moment later.
* ``reader``: a reader holding leases on the last 3 versions it checked out is killed while a
  ``KeepLast(2)`` trainer commits: its leases must vanish and retention must remove what it held.
* ``upload``: the trainer writes through to S3 (a moto server on 127.0.0.1) and is killed during
  pushes. Every version record in the bucket must be complete and pull bit-identical into a fresh
  root; every version the trainer saw persisted must be there; remote GC must leave nothing.
* ``fetch``: a reader host with an empty root checks out versions from the remote (pull) or from a
  peer host (Mooncake TCP, shared Redis registry) and is killed mid-fetch. Its store must verify
  clean, GC must leave nothing, and checking out again the versions it had not finished (up to 4,
  the interrupted one first) must give the right bytes.

How: every child writes a journal (JSON lines, each fsynced): a trainer writes ``begin`` with the
step and the sha256 of the tensors it commits before calling ``commit``, and ``done`` once
``handle.result()`` returned. After each kill a checker process (nothing else running) opens the
store and records: ``verify()``, the sha256 of every visible version, ``gc()``, the objects and
temporary files left after it. The campaign then counts

* **torn**: a visible version that does not verify, whose bytes differ from the journal's sha for
  its step, or that no trainer ever began;
* **lost**: a step reported committed (or seen visible at an earlier check) that is gone, unless
  ``KeepLast(n)`` may have pruned it (n newer versions are visible) or the campaign pruned it
  (after each check of ``commit`` and ``upload``, ``KeepLast(3)``, to keep the store small);
* **resumed OK**: the next trainer (same ``run_id``) commits latest + 1 (a final trainer after the
  last kill); for ``fetch``, checking every version out again works;
* **leaked**: objects no version references and files in ``tmp/`` after ``gc()`` (and, for
  ``upload``, unreferenced objects, manifests and locks in the bucket after ``gc(tier="remote")``).

Kills land uniformly 0.05-1.5 s after a child reports ready (a fetcher: 0.02-1.0 s; 15% of the
trainers of ``commit``, ``retention`` and ``upload`` are killed 0-0.4 s after they start, while
they open the store and resume: the next trainer's resume covers them). Every wait has a timeout
(``--kill-timeout``; a hung check counts as a failure), the whole run stops at ``--max-seconds``,
and every child, server and directory on /dev/shm is removed on exit (Ctrl-C included). Exit 1 if
anything torn, lost, not resumed, leaked or hung was found (each printed with a command that
reproduces the scenario), 0 otherwise (130 if interrupted).

The Markdown table goes into a document between ``<!-- BEGIN generated:crash -->`` and
``<!-- END generated:crash -->`` with ``tools/docgen.py crash out/crash_campaign.md --json
out/crash_campaign.json --doc DOC`` (the JSON adds the provenance line).
"""

from __future__ import annotations

import abc
import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from benchlib import log, machine, write_outputs

SCENARIOS = ("commit", "retention", "prune-gc", "reader", "upload", "fetch")
KILL_WINDOW = (0.05, 1.5)  # seconds after a child reports ready
EARLY, EARLY_WINDOW = 0.15, (0.0, 0.4)  # this share of trainers is killed this soon after it starts
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_main(role: str, cfg: dict) -> None:
    """What every child runs (crash_child is preloaded in the fork server: no import cost)."""
    import crash_child

    crash_child.run(role, cfg)


def read_journal(path: str) -> list[dict]:
    """Every complete JSON line of a journal (a line cut by a kill is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


# -- processes -------------------------------------------------------------------------------
@dataclass
class Child:
    role: str
    tag: str
    journal: str
    proc: Any

    def events(self) -> list[dict]:
        return read_journal(self.journal)

    def alive(self) -> bool:
        return self.proc.is_alive()


class Campaign:
    """Starts children (forked from a server that preloaded torch + paramstore), waits for them
    with timeouts, kills them, and owns every process, server and directory it made."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        os.makedirs(args.root_dir, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="crash-campaign-", dir=args.root_dir)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["crash_child"])
        self.children: list[Child] = []
        self.servers: list[subprocess.Popen] = []
        self.sigkills = 0
        self._n = 0
        self._moto: str | None = None
        self._redis: str | None = None

    def path(self, *parts: str) -> str:
        """A path under the campaign's directory, its parent made."""
        p = os.path.join(self.dir, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def new_name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}-{self._n}"

    def start(self, role: str, cfg: dict, scenario: str) -> Child:
        tag = self.new_name(role)
        cfg = {**cfg, "tag": tag, "seed": self.args.seed, "mib": self.args.model_mib, "shard": 4 << 20,
               "journal": self.path(scenario, "journals", f"{tag}.jsonl"),
               "log": self.path(scenario, "logs", f"{tag}.log")}
        proc = self.ctx.Process(target=_child_main, args=(role, cfg), daemon=True)
        proc.start()
        child = Child(role, tag, cfg["journal"], proc)
        self.children.append(child)
        return child

    def wait(self, child: Child, ev: str = "ready", timeout: float | None = None) -> dict:
        """The child's first ``ev`` event; else ``{"ev": "error"...}``, ``{"ev": "died"}`` or
        ``{"ev": "timeout"}`` (the child is then killed)."""
        deadline = time.monotonic() + (timeout or self.args.kill_timeout)
        while True:
            for e in child.events():
                if e["ev"] in (ev, "error"):
                    return e
            if not child.alive():
                for e in child.events():
                    if e["ev"] in (ev, "error"):
                        return e
                return {"ev": "died", "exitcode": child.proc.exitcode, "log": self.tail(child)}
            if time.monotonic() > deadline:
                self.kill(child)
                return {"ev": "timeout", "log": self.tail(child)}
            time.sleep(0.01)

    def run(self, role: str, cfg: dict, scenario: str, timeout: float | None = None) -> tuple[Child, dict]:
        """Start a child and wait until it is ready (or failed); it may go on running."""
        child = self.start(role, cfg, scenario)
        return child, self.wait(child, "ready", timeout)

    def kill(self, child: Child) -> list[dict]:
        """SIGKILL the child (if it still runs); its 'error' events (an exception it died of)."""
        if child.proc.is_alive():
            os.kill(child.proc.pid, signal.SIGKILL)
            self.sigkills += 1
        child.proc.join(10)
        return [e for e in child.events() if e["ev"] == "error"]

    def tail(self, child: Child, n: int = 1500) -> str:
        try:
            with open(os.path.join(os.path.dirname(os.path.dirname(child.journal)), "logs",
                                   f"{child.tag}.log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def start_server(self, argv: list[str], port: int, timeout: float = 60) -> None:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.servers.append(proc)
        if not wait_port(port, timeout):
            raise RuntimeError(f"{argv[0]} did not listen on port {port} within {timeout} s")

    def moto(self) -> str:
        """A moto S3 server on 127.0.0.1 (one per campaign); its endpoint."""
        if self._moto is None:
            port = free_port()
            self.start_server([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], port)
            self._moto = f"http://127.0.0.1:{port}"
        return self._moto

    def redis(self) -> str:
        """A redis-server on 127.0.0.1 with a password, no persistence (one per campaign); its URL."""
        if self._redis is None:
            port, pw = free_port(), f"crash-{random.getrandbits(48):x}"
            binary = shutil.which("redis-server") or "/usr/bin/redis-server"
            self.start_server([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                               "no", "--dir", self.dir, "--requirepass", pw], port)
            self._redis = f"redis://:{pw}@127.0.0.1:{port}/0"
        return self._redis

    def warnings_seen(self) -> dict[str, dict[str, int]]:
        """The warnings children journaled, per scenario: how often each (digits as N, 120 characters)."""
        out: dict[str, dict[str, int]] = {}
        for child in self.children:
            scenario = os.path.basename(os.path.dirname(os.path.dirname(child.journal)))
            for e in child.events():
                if e["ev"] == "warning":  # steps and names with digits counted as one
                    key = f"{e['category']}: " + re.sub(r"\d+", "N", e["msg"])[:120]
                    out.setdefault(scenario, {})[key] = out.get(scenario, {}).get(key, 0) + 1
        return out

    def cleanup(self) -> None:
        for child in self.children:
            if child.proc.is_alive():
                os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.join(10)
        for proc in self.servers:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- judging ---------------------------------------------------------------------------------
@dataclass
class Result:
    """One scenario's counts, and its problems (each with a kill record)."""

    scenario: str
    kills: int = 0
    versions_checked: int = 0
    torn: int = 0
    lost: int = 0
    resumed: int = 0
    resume_checks: int = 0
    leaked: int = 0
    seconds: float = 0.0
    problems: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    def problem(self, kind: str, detail: Any, record: dict | None = None) -> None:
        self.problems.append({"kind": kind, "detail": detail, "kill": record})
        log(f"  PROBLEM [{self.scenario}] {kind}: {json.dumps(detail)[:400]}")

    def phases(self) -> dict[str, int]:
        """Where the kills landed: with a commit in flight, an upload pending, mid-fetch."""
        def count(key: str) -> int:
            return sum(bool(r.get(key)) for r in self.records)
        return {"commit_in_flight": count("in_flight"), "upload_pending": count("uploads_pending"),
                "mid_fetch": count("mid_fetch")}

    def row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "kills": self.kills, "versions_checked": self.versions_checked,
                "torn": self.torn, "lost": self.lost, "resumed_ok": f"{self.resumed}/{self.resume_checks}",
                "leaked_after_gc": self.leaked, "seconds": round(self.seconds, 1)}


class Book:
    """What the trainers of one store said (journals) and what the checks saw."""

    def __init__(self, keep: int | None) -> None:
        self.keep = keep  # KeepLast(n) in force (trainer or pruner); None: nothing prunes but the campaign
        self.expected: dict[int, str] = {}  # step -> sha of its tensors (from 'begin')
        self.done: set[int] = set()  # handle.result() returned
        self.persisted: set[int] = set()
        self.seen: set[int] = set()  # visible at an earlier check
        self.pruned: set[int] = set()  # pruned by the campaign itself
        self.latest: int | None = None  # newest visible at the last check

    def absorb(self, events: list[dict]) -> None:
        for e in events:
            if e["ev"] == "begin":
                self.expected[e["step"]] = e["sha"]
            elif e["ev"] == "done":
                self.done.add(e["step"])
            elif e["ev"] == "persisted":
                self.persisted.add(e["step"])

    def in_flight(self, events: list[dict]) -> list[int]:
        begun = {e["step"] for e in events if e["ev"] == "begin"}
        return sorted(begun - {e["step"] for e in events if e["ev"] == "done"})

    def torn(self, visible: list[int], shas: dict[str, str], damaged: list[int]) -> list[dict]:
        out = []
        for s in visible:
            got, want = shas.get(str(s)), self.expected.get(s)
            if s in damaged:
                out.append({"step": s, "why": "verify reports it damaged"})
            elif want is None:
                out.append({"step": s, "why": "visible, but no trainer began it"})
            elif got != want:
                out.append({"step": s, "why": f"bytes differ from the journal: {str(got)[:200]}"})
        return out

    def lost(self, visible: list[int]) -> list[dict]:
        out = []
        vis = set(visible)
        for s in sorted((self.done | self.seen) - vis - self.pruned):
            newer = sum(v > s for v in vis)
            if self.keep is not None and newer >= self.keep:
                continue  # KeepLast(keep) may have pruned it
            out.append({"step": s, "reported_committed": s in self.done, "seen_before": s in self.seen,
                        "newer_visible": newer})
        return out

    def after_check(self, visible: list[int], pruned: list[int]) -> None:
        self.seen |= set(visible)
        self.pruned |= set(pruned)
        self.seen -= self.pruned
        left = set(visible) - set(pruned)
        self.latest = max(left) if left else self.latest


def judge_store(res: Result, book: Book, check: dict, record: dict) -> None:
    """Torn, lost and leaked from a checker's observations of a trainer's store."""
    if check.get("no_store"):  # killed before its first commit created the store
        record["no_store"] = check["files"]
        lost = book.lost([])
        if lost:
            res.lost += len(lost)
            res.problem("lost", lost, record)
        return
    visible = check["versions"]
    v = check["verify"]
    damaged = v.get("damaged_versions", []) + [int(s) for s in v.get("unreadable_manifests", {})]
    torn = book.torn(visible, check["sha"], damaged)
    lost = book.lost(visible)
    leaked = check["after_gc"]["orphans"] + check["after_gc"]["tmp"]
    res.versions_checked += len(visible)
    record.update(visible=visible, verify_ok=v["ok"], leftovers_before_gc=len(v.get("leftovers", [])),
                  orphans_before_gc=len(v.get("orphans", [])), gc=check["gc"], check_s=round(check["seconds"], 2))
    if torn:
        res.torn += len(torn)
        res.problem("torn", torn, record)
    if lost:
        res.lost += len(lost)
        res.problem("lost", lost, record)
    if leaked:
        res.leaked += len(leaked)
        res.problem("leaked", {"after_gc": check["after_gc"]}, record)
    if check["after_gc"]["quarantine"]:
        res.problem("quarantine", check["after_gc"]["quarantine"], record)
    book.after_check(visible, check.get("campaign_pruned", []))


def judge_resume(res: Result, book: Book, child: Child, ready: dict, record: dict | None) -> None:
    """The trainer started after a kill must commit latest + 1 first (silently taking the store back)."""
    res.resume_checks += 1
    events = child.events()
    resumed = next((e["step"] for e in events if e["ev"] == "resumed"), None)
    want = (book.latest or 0) + 1
    takeovers = [e["msg"] for e in events if e["ev"] == "warning" and "taking over" in e["msg"]]
    if ready["ev"] in ("ready", "exit") and resumed == want:
        res.resumed += 1
    else:
        res.problem("resume", {"wanted_step": want, "resumed_step": resumed, "child": ready}, record)
    if takeovers:
        res.problem("takeover-warning", takeovers, record)


# -- scenarios -------------------------------------------------------------------------------
class Scenario(abc.ABC):
    """One scenario: ``rounds`` kills, each followed by a check; stops at ``deadline``."""

    name = ""

    def __init__(self, c: Campaign, rounds: int, deadline: float) -> None:
        self.c, self.rounds, self.deadline = c, rounds, deadline
        self.rng = random.Random(f"{c.args.seed}-{self.name}")
        self.res = Result(self.name)
        self.dir = os.path.join(c.dir, self.name)

    WINDOW = KILL_WINDOW

    def delay(self) -> float:
        return self.rng.uniform(*self.WINDOW)

    def check(self, cfg: dict, record: dict) -> dict | None:
        out = self.c.path(self.name, "checks", self.c.new_name("check") + ".json")
        child, ev = self.c.run("checker", {**cfg, "out": out}, self.name)
        child.proc.join(5)
        if ev["ev"] != "ready":
            self.res.problem("check-failed" if ev["ev"] != "timeout" else "hang", ev, record)
            return None
        with open(out) as f:
            return json.load(f)

    def execute(self) -> Result:
        t0 = time.monotonic()
        try:
            self._execute()
        finally:
            self.res.seconds = time.monotonic() - t0
        return self.res

    def _execute(self) -> None:
        try:
            self.setup()
            for r in range(self.rounds):
                if time.monotonic() > self.deadline:
                    log(f"{self.name}: time is up after {r} kills")
                    break
                record = {"round": r}
                self.round(r, record)
                self.res.kills += 1
                self.res.records.append(record)
                if r % 10 == 9:
                    log(f"{self.name}: {r + 1} kills, {len(self.res.problems)} problems")
            self.finish()
        except Exception as e:  # noqa: BLE001 - the scenario stops; the others go on
            self.res.problem("campaign-error", traceback.format_exc()[-2000:])
            log(f"{self.name}: stopped by {type(e).__name__}: {e}")

    def setup(self) -> None:
        pass

    def finish(self) -> None:
        pass

    @abc.abstractmethod
    def round(self, r: int, record: dict) -> None:
        """Kill once (round ``r``) and check, adding what was seen to ``record``."""


class TrainerScenario(Scenario):
    """A trainer store: each round restarts the trainer (the resume check of the previous kill),
    kills something, checks. ``keep``: the trainer's KeepLast; ``campaign_keep``: what the check
    prunes afterwards to keep the store small."""

    keep: int | None = None
    campaign_keep: int | None = 3
    pause = 0.0

    def setup(self) -> None:
        self.root = os.path.join(self.dir, "store")
        self.book = Book(self.keep)
        self.last_record: dict | None = None

    def store_cfg(self) -> dict:
        return {"root": self.root}

    def trainer_cfg(self, **extra: Any) -> dict:
        return {**self.store_cfg(), "run_id": f"crash-{self.name}", "keep": self.keep, "pause": self.pause, **extra}

    def start_trainer(self, **extra: Any) -> tuple[Child, dict]:
        child, ev = self.c.run("trainer", self.trainer_cfg(**extra), self.name)
        if extra.get("steps") == 0 and ev["ev"] == "ready":
            ev = self.c.wait(child, "exit")
        judge_resume(self.res, self.book, child, ev, self.last_record)
        return child, ev

    def kill_trainer(self, child: Child, record: dict) -> None:
        errors = self.c.kill(child)
        if errors:
            self.res.problem("trainer-error", errors, record)
        events = child.events()
        self.book.absorb(events)
        record["in_flight"] = self.book.in_flight(events)
        record["last_event"] = events[-1]["ev"] if events else None
        if self.name == "upload":  # versions committed whose upload had not ended
            ended = {e["step"] for e in events if e["ev"] in ("persisted", "persist_failed")}
            record["uploads_pending"] = sorted({e["step"] for e in events if e["ev"] == "done"} - ended)

    def check_store(self, record: dict, **extra: Any) -> None:
        check = self.check({**self.store_cfg(), "prune_after": self.campaign_keep, **extra}, record)
        if check is not None:
            judge_store(self.res, self.book, check, record)
            if not check.get("no_store"):
                self.after_check(check, record)
        self.last_record = record

    def after_check(self, check: dict, record: dict) -> None:
        pass

    def round(self, r: int, record: dict) -> None:
        if self.rng.random() < EARLY:  # while it opens the store and resumes: judged by the next one
            record["early_delay"] = self.rng.uniform(*EARLY_WINDOW)
            trainer = self.c.start("trainer", self.trainer_cfg(), self.name)
            time.sleep(record["early_delay"])
        else:
            trainer, ev = self.start_trainer()
            if ev["ev"] == "ready":
                record["delay"] = self.delay()
                time.sleep(record["delay"])
        self.kill_trainer(trainer, record)
        self.check_store(record)

    def finish(self) -> None:
        """A last trainer: resumes after the last kill, commits one step, exits cleanly."""
        child, _ = self.start_trainer(steps=0)
        self.book.absorb(child.events())
        child.proc.join(10)


class CommitScenario(TrainerScenario):
    name = "commit"


class RetentionScenario(TrainerScenario):
    name = "retention"
    keep = 2
    campaign_keep = None


class PruneGcScenario(TrainerScenario):
    name = "prune-gc"
    campaign_keep = None

    def setup(self) -> None:
        super().setup()
        self.book.keep = 2  # the pruner's KeepLast(2)

    def round(self, r: int, record: dict) -> None:
        trainer, ev = self.start_trainer()
        if ev["ev"] == "ready":
            pruner, pev = self.c.run("pruner", {**self.store_cfg(), "keep": 2}, self.name)
            if pev["ev"] in ("died", "timeout"):  # (an error is reported with the kill)
                self.res.problem("pruner-failed", pev, record)
            record["delay"] = self.delay()
            time.sleep(record["delay"])
            errors = self.c.kill(pruner)
            if errors:
                self.res.problem("pruner-error", errors, record)
            record["pruner_last_event"] = (pruner.events() or [{"ev": None}])[-1]["ev"]
            record["trainer_delay"] = self.rng.uniform(0, 0.3)
            time.sleep(record["trainer_delay"])
        self.kill_trainer(trainer, record)
        self.check_store(record)


class ReaderScenario(TrainerScenario):
    name = "reader"
    keep = 2
    campaign_keep = None

    def round(self, r: int, record: dict) -> None:
        trainer, ev = self.start_trainer()
        if ev["ev"] == "ready":
            reader, rev = self.c.run("reader", self.store_cfg(), self.name)
            if rev["ev"] in ("died", "timeout"):
                self.res.problem("reader-failed", rev, record)
            record["delay"] = self.delay()
            time.sleep(record["delay"])
            errors = self.c.kill(reader)
            if errors:
                self.res.problem("reader-error", errors, record)
            held = sorted({e["step"] for e in reader.events() if e["ev"] == "leased"})
            record["held"] = held
            self.watch_leases(reader, held, record)
        self.kill_trainer(trainer, record)
        self.check_store(record)

    def watch_leases(self, reader: Child, held: list[int], record: dict) -> None:
        """The killed reader's leases vanish and retention removes what it held (trainer still running)."""
        out = self.c.path(self.name, "checks", self.c.new_name("leases") + ".json")
        cfg = {**self.store_cfg(), "held": held, "pid": reader.proc.pid, "keep": 2, "timeout": 15, "out": out}
        _, ev = self.c.run("lease_watch", cfg, self.name, timeout=30)
        if ev["ev"] != "ready":
            self.res.problem("hang" if ev["ev"] == "timeout" else "check-failed", ev, record)
            return
        with open(out) as f:
            seen = json.load(f)
        record["leases_released_s"] = round(seen.get("waited", -1), 2)
        if not seen["ok"]:
            self.res.problem("leases", seen, record)


class UploadScenario(TrainerScenario):
    """Write-through to S3; the bucket changes every ``BLOCK`` kills (the old one is deleted)."""

    name = "upload"
    pause = 0.15  # give pushes a chance to keep up (else most versions are skipped by the backlog)
    BLOCK = 10

    def setup(self) -> None:
        super().setup()
        self.endpoint = self.c.moto()
        self.block = -1
        self.new_bucket()

    def new_bucket(self) -> None:
        if self.block >= 0:
            self.c.run("bucket", {"endpoint": self.endpoint, "bucket": self.bucket, "op": "delete"}, self.name)
            shutil.rmtree(self.pull_root, ignore_errors=True)
        self.block += 1
        self.bucket = f"crash-{self.c.args.seed}-{self.block}"
        self.pull_root = os.path.join(self.dir, f"pulled-{self.block}")
        self.checked_records: list[int] = []
        self.book.persisted = set()  # 'persisted' means: to the current bucket
        _, ev = self.c.run("bucket", {"endpoint": self.endpoint, "bucket": self.bucket, "op": "create"}, self.name)
        if ev["ev"] != "ready":
            raise RuntimeError(f"cannot create bucket {self.bucket}: {ev}")

    def store_cfg(self) -> dict:
        return {"root": self.root, "remote": f"s3://{self.bucket}/run", "storage_options": s3_options(self.endpoint)}

    def round(self, r: int, record: dict) -> None:
        if r and r % self.BLOCK == 0:
            self.new_bucket()
        record["bucket"] = self.bucket
        super().round(r, record)

    def check_store(self, record: dict, **extra: Any) -> None:
        super().check_store(record, check_bucket=True, pull_root=self.pull_root, pull_prune=True,
                            checked_records=self.checked_records)

    def after_check(self, check: dict, record: dict) -> None:
        b = check["bucket"]
        new = [s for s in b["records"] if s not in self.checked_records]
        self.res.versions_checked += len(new)
        record.update(records=len(b["records"]), pulled=new, remote_gc=b["remote_gc"])
        torn = [{"step": s, "why": "record incomplete", "lacking": o} for s, o in b["incomplete"].items()]
        for s in new:
            got, want = b["pull_sha"].get(str(s)), self.book.expected.get(s)
            if got != want:
                torn.append({"step": s, "why": f"pulled bytes differ from the journal: {str(got)[:200]}"})
        if not b["pull_verify"]["ok"]:
            torn.append({"why": "fresh root does not verify", "verify": b["pull_verify"]})
        lost = sorted(self.book.persisted - set(b["records"]))
        leaked = b["leaked"]["objects"] + b["leaked"]["manifests"] + b["leaked"]["locks"]
        if torn:
            self.res.torn += len(torn)
            self.res.problem("torn-remote", torn, record)
        if lost:
            self.res.lost += len(lost)
            self.res.problem("lost-remote", {"persisted_but_no_record": lost}, record)
        if leaked:
            self.res.leaked += len(leaked)
            self.res.problem("leaked-remote", b["leaked"], record)
        self.checked_records = sorted(set(self.checked_records) | set(new))


class FetchScenario(Scenario):
    """A reader host killed mid-fetch, from the remote (pull) or from a peer (Mooncake + Redis),
    alternately. The sources are seeded once with ``VERSIONS`` versions; each round's reader
    host has a fresh root and checks them out in a random order."""

    name = "fetch"
    VERSIONS = 16
    WINDOW = (0.02, 1.0)  # a peer host fetches all 16 versions in about 1 s
    REFETCH = 4  # versions checked out again after a kill

    def setup(self) -> None:
        self.book = Book(None)
        self.sources: dict[str, dict] = {}
        endpoint = self.c.moto()
        bucket = f"crash-fetch-{self.c.args.seed}"
        self.c.run("bucket", {"endpoint": endpoint, "bucket": bucket, "op": "create"}, self.name)
        remote = {"remote": f"s3://{bucket}/run", "storage_options": s3_options(endpoint)}
        self.seed("remote", {"root": os.path.join(self.dir, "seed-remote"), **remote}, remote)
        if importlib.util.find_spec("mooncake") is None:
            self.res.problem("note", "mooncake is not installed: peer fetches skipped")
        else:
            redis = {"registry": self.c.redis(), "name": f"crash-{self.c.args.seed}"}
            self.seed("peer", {"root": os.path.join(self.dir, "seed-peer"), "serve": True, **redis}, redis)

    def seed(self, mode: str, cfg: dict, reader_cfg: dict) -> None:
        child, ev = self.c.run("seeder", {**cfg, "run_id": f"seed-{mode}", "n": self.VERSIONS}, self.name,
                               timeout=300)
        if ev["ev"] != "ready":
            raise RuntimeError(f"seeding the {mode} source failed: {ev}")
        self.book.absorb(child.events())
        self.sources[mode] = reader_cfg

    def round(self, r: int, record: dict) -> None:
        modes = sorted(self.sources)
        mode = modes[r % len(modes)]
        root = os.path.join(self.dir, f"reader-{r}")
        cfg = {"root": root, **self.sources[mode]}
        steps = list(range(1, self.VERSIONS + 1))
        self.rng.shuffle(steps)
        record.update(mode=mode)
        child, ev = self.c.run("fetcher", {**cfg, "steps": steps}, self.name)
        if ev["ev"] == "ready":
            record["delay"] = self.delay()
            time.sleep(record["delay"])
        elif ev["ev"] in ("died", "timeout"):
            self.res.problem("fetcher-failed", ev, record)
        errors = self.c.kill(child)
        if errors:
            self.res.problem("fetcher-error", errors, record)
        events = child.events()
        record["fetched_before_kill"] = [e["step"] for e in events if e["ev"] == "fetched"]
        record["last_event"] = events[-1]["ev"] if events else None
        record["mid_fetch"] = record["last_event"] in ("ready", "fetched")
        torn = [{"step": e["step"], "why": "checked out wrong bytes before the kill"}
                for e in events if e["ev"] == "fetched" and e["sha"] != self.book.expected[e["step"]]]
        # Check out again what the killed fetcher had not finished: the interrupted version first.
        refetch = [s for s in steps if s not in record["fetched_before_kill"]][:self.REFETCH] or steps[:1]
        check = self.check({**cfg, "reader_host": mode == "peer", "refetch": refetch}, record)
        if check is not None:
            self.judge(check, torn, record)
        shutil.rmtree(root, ignore_errors=True)

    def judge(self, check: dict, torn: list[dict], record: dict) -> None:
        res = self.res
        v = check.get("verify") or check["verify_local"]
        if not v["ok"]:
            torn.append({"why": "does not verify after the kill", "verify": v})
        local = check.get("local_versions", check["versions"])
        torn += self.book.torn(local, check["sha"], [])
        leaked = check["after_gc"]["orphans"] + check["after_gc"]["tmp"]
        refetch_bad = {s: sha for s, sha in check["refetch_sha"].items() if sha != self.book.expected[int(s)]}
        res.versions_checked += len(local) + len(check["refetch_sha"])
        record.update(local_after_kill=local, gc=check["gc"], check_s=round(check["seconds"], 2))
        res.resume_checks += 1
        if refetch_bad or not check["verify_after_refetch"]["ok"]:
            res.problem("refetch", {"bad": refetch_bad, "verify": check["verify_after_refetch"]}, record)
        else:
            res.resumed += 1
        if torn:
            res.torn += len(torn)
            res.problem("torn", torn, record)
        if leaked:
            res.leaked += len(leaked)
            res.problem("leaked", check["after_gc"], record)


SCENARIO_CLASSES: dict[str, type[Scenario]] = {
    cls.name: cls for cls in (CommitScenario, RetentionScenario, PruneGcScenario, ReaderScenario,
                              UploadScenario, FetchScenario)}


# -- servers ---------------------------------------------------------------------------------
def s3_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 20, "retries": {"max_attempts": 2}}}


# -- output ----------------------------------------------------------------------------------
COLUMNS = [("scenario", "scenario"), ("kills", "kills"), ("versions_checked", "versions checked"),
           ("torn", "torn"), ("lost", "lost"), ("resumed_ok", "resumed OK"),
           ("leaked_after_gc", "leaked objects after gc"), ("seconds", "seconds")]


def table(rows: list[dict], markdown: bool) -> str:
    heads = [h for _, h in COLUMNS]
    cells = [[str(r[k]) for k, _ in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(" --- " for _ in heads) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [heads, *cells])


def repro(args: argparse.Namespace, scenario: str, kills: int) -> str:
    return (f".venv/bin/python tools/crash_campaign.py --scenarios {scenario} --kills {kills} "
            f"--seed {args.seed} --model-mib {args.model_mib} --keep")


def report(args: argparse.Namespace, results: list[Result], total: float, sigkills: int,
           warned: dict[str, dict[str, int]]) -> int:
    rows = [r.row() for r in results]
    print(table(rows, markdown=False))
    failures = [(r, p) for r in results for p in r.problems if p["kind"] not in ("note", "takeover-warning")]
    for r, p in failures:
        print(f"\nFAIL {r.scenario} {p['kind']} (kill {p['kill'] and p['kill'].get('round')}): "
              f"{json.dumps(p['detail'])[:1500]}\n  reproduce: {repro(args, r.scenario, r.kills)}")
    for r in results:
        for p in r.problems:
            if p["kind"] in ("note", "takeover-warning"):
                print(f"\nnote {r.scenario}: {json.dumps(p['detail'])[:500]}")
    print(f"\n{sum(r.kills for r in results)} kills ({sigkills} SIGKILLs in all) in {total:.0f} s: "
          + ("no torn or lost version, every resume worked, nothing leaked" if not failures
             else f"{len(failures)} problems"))
    out = {"argv": [os.path.relpath(sys.argv[0])] + sys.argv[1:], "seed": args.seed, "machine": machine(),
           "total_seconds": total, "sigkills": sigkills, "ok": not failures, "table": rows,
           "scenarios": {r.scenario: {**r.row(), "kills_landed": r.phases(), "problems": r.problems,
                                      "warnings": warned.get(r.scenario, {}), "kills_detail": r.records}
                         for r in results}}
    write_outputs(args.json, out, args.markdown, table(rows, markdown=True))
    return 1 if failures else 0


# -- main ------------------------------------------------------------------------------------
def spread(total: int, names: list[str]) -> dict[str, int]:
    """``total`` kills over the scenarios, the remainder to the first ones."""
    return {n: total // len(names) + (i < total % len(names)) for i, n in enumerate(names)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=300, help="kills in all, spread over the scenarios (default 300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {', '.join(SCENARIOS)}")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--markdown", metavar="OUT")
    ap.add_argument("--root-dir", default="/dev/shm", help="where the stores are made (default /dev/shm)")
    ap.add_argument("--max-seconds", type=float, default=720, help="stop starting kills after this (default 720)")
    ap.add_argument("--kill-timeout", type=float, default=60, help="limit of each wait for a child (default 60 s)")
    ap.add_argument("--model-mib", type=int, default=8, help="MiB of tensors per version (default 8)")
    ap.add_argument("--keep", action="store_true", help="keep the campaign's directory (for a post-mortem)")
    args = ap.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        ap.error(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    args.names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.update(MC_FORCE_TCP="1", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", PYTHONWARNINGS="ignore::DeprecationWarning")
    # The fork server imports crash_child (and with it torch and paramstore) once; Python 3.11's
    # fork server ignores the parent's sys.path, so it finds tools/ through PYTHONPATH.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    for sig in (signal.SIGINT, signal.SIGTERM):  # cleanup on Ctrl-C and SIGTERM (even if started with SIGINT ignored)
        signal.signal(sig, signal.default_int_handler)
    t0 = time.monotonic()
    c = Campaign(args)
    log(f"campaign in {c.dir}: {args.kills} kills over {', '.join(args.names)}, seed {args.seed}")
    results: list[Result] = []
    interrupted = False
    try:
        plan = spread(args.kills, args.names)
        for i, name in enumerate(args.names):
            left = sum(plan[n] for n in args.names[i:])
            budget = (args.max_seconds - (time.monotonic() - t0)) * plan[name] / max(1, left)
            log(f"--- {name}: {plan[name]} kills, {budget:.0f} s")
            scenario = SCENARIO_CLASSES[name](c, plan[name], time.monotonic() + budget)
            results.append(scenario.res)  # reported even if interrupted
            scenario.execute()
            log(f"--- {name}: {scenario.res.row()}")
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
    finally:
        seen = c.warnings_seen()
        c.cleanup()
    status = report(args, results, time.monotonic() - t0, c.sigkills, seen)
    return 130 if interrupted else status


if __name__ == "__main__":
    sys.exit(main())
