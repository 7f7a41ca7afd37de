"""The ``paramstore`` command line.

``paramstore [--root PATH] [--remote URL] [--registry URL --name N] [--json] COMMAND ...``; these
common options go before or after the command (given in both places, the one after wins). The root
may also come from ``$PARAMSTORE_ROOT``, the remote from ``$PARAMSTORE_REMOTE``, the registry and
name from ``$PARAMSTORE_REGISTRY``/``$PARAMSTORE_NAME`` (credentials and endpoints the usual way for
the protocol: for S3, ``AWS_*`` variables such as ``AWS_ENDPOINT_URL``, or ``~/.aws``).
Also ``python -m paramstore ...`` and ``paramstore --version``.
Every command goes through the public :class:`~paramstore.ParamStore` API. Every command but ``diff``
runs without importing torch, so they start fast.
Exit status: 0 on success, 1 when ``verify`` finds damage, 2 on an error (message on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

from . import __version__
from .errors import (
    InvalidArgumentError, NotAStoreError, ParamStoreError, ParamStoreWarning, TagNotFoundError, VersionNotFoundError,
)
from .metrics import serve as serve_metrics
from .retention import AnyOf, KeepBest, KeepEvery, KeepLast, KeepTagged, KeepWithin, Policy, infer_mode
from .root import MARKER, VersionSpec
from .store import ParamStore
from .text import plural

__all__ = ["main"]


def _version_arg(text: str) -> VersionSpec:
    return int(text) if text.isascii() and text.isdigit() else text  # anything else: resolved (and refused) by the store


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


# -- commands: each returns (json-able result, text to print, exit code) ----------------------
def _serve(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    import signal
    import threading

    if args.registry is None and args.metrics_port is None:
        raise ParamStoreError("serve needs a registry shared by the hosts: --registry redis://... --name NAME "
                              "(or --metrics-port N alone: this store's metrics only)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    out: dict[str, Any] = {}
    if args.metrics_port is not None:  # the store was opened with metrics=True (_opened)
        exporter = serve_metrics(args.metrics_port, args.metrics_host)
        out["metrics"] = url = f"http://{args.metrics_host}:{exporter.server_port}/metrics"
        print(f"serving the metrics of {store.root} at {url}", file=sys.stderr, flush=True)
    if args.registry is not None:
        server = store.serve(args.host)
        out.update(session=server.peer.session, peer=server.peer.id)
        print(f"serving {plural(len(server.served), 'object')} of {store.root} at {server.peer.session} "
              f"(peer {server.peer.id}); Ctrl-C to stop", file=sys.stderr, flush=True)
    stop.wait()
    return out, "stopped", 0


def _needs_remote(args: argparse.Namespace) -> bool:
    """Whether the command talks to the remote (only then is it opened: a network call)."""
    return args.command in ("push", "pull") or getattr(args, "tier", "local") == "remote"


def _repairs(args: argparse.Namespace) -> bool:
    """``verify --repair``: opens the remote when one is named (a source of good copies), without needing one."""
    return args.command == "verify" and bool(getattr(args, "repair", False))


_VERSION_HELP = "a step, 'latest' or a tag"

def _metrics(metrics: Any) -> str:
    """``loss=0.1235 reward=3``: compact, numbers to 4 significant digits."""
    def fmt(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)
    return " ".join(f"{k}={fmt(x)}" for k, x in metrics.items())


def _ls(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    if args.tier == "remote":
        versions, persisted = store.remote_versions(), None
    else:
        versions, persisted = store.versions(), store.persisted()
    metrics = [_metrics(v.metrics) for v in versions]
    width = max([len("METRICS"), *map(len, metrics)])
    wwidth = max([len("WRITER"), *(len(v.writer or "-") for v in versions)])
    rows = [f"{'STEP':>10}  {'CREATED (UTC)':19}  {'SIZE':>11}  {'TENSORS':>7}  {'DIGEST':12}  "
            f"{'' if persisted is None else 'PERSISTED  '}{'WRITER':{wwidth}}  {'METRICS':{width}}  TAGS"]
    out = []
    for v, m in zip(versions, metrics):
        mark = "" if persisted is None else f"{'yes' if v.step in persisted else 'no':9}  "
        rows.append(f"{v.step:>10}  {_when(v.created_at)}  {_human(v.nbytes):>11}  {v.num_tensors:>7}  "
                    f"{v.digest[:12]}  {mark}{v.writer or '-':{wwidth}}  {m:{width}}  {','.join(v.tags)}".rstrip())
        out.append(v.as_dict() if persisted is None else {**v.as_dict(), "persisted": persisted.get(v.step)})
    return out, "\n".join(rows), 0


def _push(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    url = store.remote.url  # type: ignore[union-attr]
    if args.version:
        steps: list[VersionSpec] = list(args.version)
    else:  # every local version not yet in this remote
        done = {s for s, u in store.persisted().items() if u == url}
        steps = [v.step for v in store.versions() if v.step not in done]
    reports = [store.push(s, show_progress=None) for s in steps]
    lines = [f"pushed step {r.step}: {plural(r.objects, 'object')} ({_human(r.bytes)}) uploaded{_patched(r)}, {r.skipped} "
             f"already there, {r.seconds:.1f} s" for r in reports]
    return [r.as_dict() for r in reports], "\n".join(lines) or "nothing to push", 0


def _pull(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.pull(args.version, show_progress=None)
    text = (f"pulled step {r.step}: {plural(r.objects, 'object')} ({_human(r.bytes)}) downloaded and verified{_patched(r)}, "
            f"{r.skipped} already here, {r.seconds:.1f} s")
    return r.as_dict(), text, 0


def _patched(r: Any) -> str:
    """`` (N of them as patches, X)`` for a transfer that moved patches instead of objects."""
    if not r.from_patches:
        return ""
    return f" ({plural(len(r.from_patches), 'object')} as patches: {_human(r.patch_bytes)})"


def _show(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    """A version and one line per name: dtype, global shape, size, digest, and for a tensor committed
    sharded its chunk count (the manifest's format says whether it holds any: 2, or 1); then one
    line per asset (format 3)."""
    v = store.get(args.version)
    man = store.manifest(v.step)
    out = {**v.as_dict(), "objects": sorted(man.objects()), "manifest": man.to_json()}
    out["patches"] = [{"base": base, **info} for (base, _), info in sorted(store.patches(v.step).items())]
    patches = ", ".join(f"from {p['base']}: {_human(p['bytes'])} for {plural(p['changed'], 'object')}" for p in out["patches"])
    chunked = sum(1 for e in man.tensors.values() if e.chunks)
    # tensors counted as ls counts them (Version.num_tensors): an alias is a tensor name too
    tensors = plural(len(man.tensors) + len(man.aliases), "tensor") + (
        f" ({plural(len(man.aliases), 'alias', 'aliases')})" if man.aliases else "")
    layout = f"{plural(chunked, 'tensor')} chunked" if chunked else "every tensor whole"
    assets = f", {plural(len(man.assets), 'asset')}" if man.assets else ""
    lines = [
        f"step       {v.step}", f"created    {_when(v.created_at)} UTC", f"digest     {v.digest}",
        f"size       {_human(v.nbytes)} in {tensors}, {plural(len(man.objects()), 'object')}",
        f"format     {out['manifest']['format']} ({layout}{assets})",
        f"patches    {patches or '-'}",
        f"tags       {', '.join(v.tags) or '-'}", f"writer     {v.writer or '-'}",
        f"metrics    {json.dumps(dict(v.metrics))}", f"metadata   {json.dumps(dict(v.metadata))}", "",
    ]
    for n in man.names():
        e = man.entry(n)
        chunks = f"  {plural(len(e.chunks), 'chunk')}" if e.chunks else ""
        alias = f"  (alias of {man.aliases[n]})" if n in man.aliases else ""
        lines.append(f"  {n}  {e.dtype}{list(e.shape)}  {_human(e.nbytes)}  {e.digest[:12]}{chunks}{alias}")
    for n, e in sorted(man.assets.items()):
        lines.append(f"  [asset] {n}  {_human(e.nbytes)}  {e.digest[:12]}")
    return out, "\n".join(lines), 0


def _diff(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.diff(args.a, args.b)
    lines = [f"{r['from']} -> {r['to']}: {len(r['changed'])} changed ({_human(r['changed_bytes'])}), "
             f"{len(r['added'])} added, {len(r['removed'])} removed, {r['unchanged']} unchanged"]
    lines += [f"+ {n}" for n in r["added"]] + [f"- {n}" for n in r["removed"]]
    for c in r["changed"]:
        detail = f"max|Δ|={c['max_abs_diff']:.6g}" if "max_abs_diff" in c else \
            (f"{c['from']} -> {c['to']}" if "from" in c else "")
        relayout = "  (chunk layout changed)" if c.get("relayout") else ""
        lines.append(f"~ {c['name']}  {_human(c['nbytes'])}  {detail}{relayout}".rstrip())
    for mark, what in (("+", "added"), ("-", "removed"), ("~", "changed")):
        lines += [f"{mark} asset {n}" for n in r.get("assets", {}).get(what, [])]
    return r, "\n".join(lines), 0


def _verify(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.verify(args.version, repair=args.repair, show_progress=None)
    lines = [f"checked {plural(r['versions_checked'], 'version')}, {plural(r['objects_checked'], 'object')}, "
             f"{_human(r['bytes_checked'])}"]
    lines += [f"CORRUPT {o}: {why}" for o, why in r["corrupt"].items()]
    set_aside = set(r.get("quarantined_missing", ()))
    lines += [f"MISSING {o}{' (quarantined as damaged)' if o in set_aside else ''}" for o in r["missing"]]
    lines += [f"UNREADABLE manifest of step {s}: {why}" for s, why in r.get("unreadable_manifests", {}).items()]
    if r["damaged_versions"]:
        lines.append(f"damaged versions: {', '.join(map(str, r['damaged_versions']))}")
    if "orphans" in r:
        lines.append(f"{plural(len(r['orphans']), 'unreferenced object')}, {plural(len(r['leftovers']), 'temporary file')} "
                     "(in-flight commits or crash leftovers; reclaimed by gc)"
                     + (f"; {plural(r['patch_objects'], 'patch object')} (patches between versions, kept by gc)"
                        if r.get("patch_objects") else ""))
    if args.repair:
        lines += [f"quarantined {o} -> {path}" for o, path in r["quarantined"].items()]
        lines += [f"restored {o}" for o in r["restored"]]
        lines += [f"still damaged: step {s}: {why}" for s, why in r["unrepaired"].items()]
        lines.append(("REPAIRED" if r["damaged_versions"] else "OK") if r["ok"] else "DAMAGED")
    else:
        lines.append("OK" if r["ok"] else "DAMAGED")
    if r.get("advice"):
        lines.append(f"next: {r['advice']}")
    return r, "\n".join(lines), 0 if r["ok"] else 1


def _rm(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    v = store.remove(args.version)
    return ({"removed": v.step, "digest": v.digest},
            f"removed step {v.step} ({v.digest[:12]}); run `paramstore gc` to free its objects", 0)


def _du(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.du()
    text = (f"{plural(r['versions'], 'version')}, {plural(r['objects'], 'object')}\n"
            f"logical  {_human(r['logical_bytes'])}\nstored   {_human(r['stored_bytes'])}\n"
            f"patches  {_human(r['patch_bytes'])} in {plural(r['patch_objects'], 'object')} (of the stored)\n"
            f"temp     {_human(r['temporary_bytes'])}\ndedup    {r['dedup_ratio']:.2f}x")
    return r, text, 0


def _export(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.export(args.version, args.dir, shard_size_bytes=args.shard_size_bytes, show_progress=None,
                     assets_from=args.assets_from, weights_only=args.weights_only, recipe=args.recipe)
    how = "" if args.recipe is None else f" in the form of recipe {args.recipe}"
    return r, f"exported step {r['step']}{how} to {r['directory']}: {', '.join(r['files'])}", 0


def _tag(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    if args.delete:
        step = store.untag(args.tag)
        return {"deleted": args.tag, "step": step}, f"deleted tag {args.tag} (was step {step})", 0
    if args.version is None:
        raise ParamStoreError("tag needs a version: paramstore tag VERSION NAME (or --delete NAME)")
    # As `git tag`: an existing tag is moved only with --force (and the output says from where).
    target = store.get(args.version).step
    try:
        current: int | None = store.get(args.tag).step
    except TagNotFoundError:
        current = None
    if current is not None and current != target and not args.force:
        raise InvalidArgumentError(f"tag {args.tag!r} already points at step {current}: pass --force to move it to "
                                   f"step {target} (paramstore tag --force {target} {args.tag})")
    step = store.tag(target, args.tag).step
    moved = current if current is not None and current != step else None
    text = f"{args.tag} -> {step}" + (f" (moved from step {moved})" if moved is not None else "")
    return {"tag": args.tag, "step": step, "moved_from": moved}, text, 0


def _leases(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    import time

    now = time.time()
    leases = sorted(store.leases(), key=lambda lease: lease.step)
    rows = [f"{'STEP':>10}  {'AGE':>9}  {'PID':>7}  HOLDER"]
    rows += [f"{lease.step:>10}  {now - lease.acquired_at:8.1f}s  {lease.pid:>7}  {lease.holder}" for lease in leases]
    out = [{"step": lease.step, "holder": lease.holder, "pid": lease.pid, "host": lease.host,
            "age_s": now - lease.acquired_at, "id": lease.id} for lease in leases]
    return out, "\n".join(rows) if leases else "no live leases", 0


def _policy_from_flags(args: argparse.Namespace) -> "Policy":
    """The policy the keep flags describe (keep if any keeps).

    Tagged versions are always kept (``KeepTagged()`` is added) unless ``--prune-tagged`` says
    otherwise; then only ``--keep-tag`` protects tags. ``--keep-best`` takes its direction from
    ``--mode`` or, for a well-known metric name (``loss``: min, ``reward``: max), from the name;
    any other metric without ``--mode`` is refused.
    """
    rules: list[Policy] = []
    if args.keep_last is not None:
        rules.append(KeepLast(args.keep_last))
    if args.keep_every is not None:
        rules.append(KeepEvery(args.keep_every))
    if args.keep_best is not None:
        if not args.metric:
            raise InvalidArgumentError("--keep-best needs --metric NAME")
        mode = args.mode or infer_mode(args.metric)
        if mode is None:
            raise InvalidArgumentError(
                f"--keep-best cannot tell whether a higher or a lower {args.metric!r} is better: "
                "add --mode max (higher is better) or --mode min (lower is better)")
        rules.append(KeepBest(args.keep_best, args.metric, mode=mode))
    elif args.metric or args.mode:
        raise InvalidArgumentError(f"{'--metric' if args.metric else '--mode'} goes with --keep-best")
    if args.keep_tag:
        rules.append(KeepTagged(*args.keep_tag))  # validated even when every tag is kept anyway
    if args.keep_within is not None:
        rules.append(KeepWithin(args.keep_within))
    if not rules:
        raise InvalidArgumentError(
            "no keep flag given: refusing to prune everything but the latest version; "
            "pass at least one of --keep-last, --keep-every, --keep-best, --keep-tag, --keep-within")
    if not args.prune_tagged:  # every tagged version, which subsumes --keep-tag
        rules = [r for r in rules if not isinstance(r, KeepTagged)] + [KeepTagged()]
    return rules[0] if len(rules) == 1 else AnyOf(*rules)


def _prune(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    r = store.prune(_policy_from_flags(args), dry_run=args.dry_run, tier=args.tier)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"policy: {r.policy}"]
    # one column per field whatever the verb: VERB (7 wide), STEP (right-aligned), why
    lines += [f"{'keep':7} {step:>10}  {'; '.join(why)}" for step, why in r.kept.items()]
    lines += [f"{'remove' if args.dry_run else 'removed':7} {step:>10}" for step in r.removed]
    lines += [f"{'spared':7} {step:>10}  (leased or latest meanwhile)" for step in r.spared]
    lines.append(f"{verb} {plural(len(r.removed), 'version')}, kept {len(r.kept)}; run `paramstore gc"
                 f"{' --tier remote' if args.tier == 'remote' else ''}` to free their objects")
    return r.as_dict(), "\n".join(lines), 0


def _gc(store: ParamStore, args: argparse.Namespace) -> tuple[Any, str, int]:
    verb = "would delete" if args.dry_run else "deleted"
    r = store.gc(dry_run=args.dry_run, tier=args.tier, grace=args.grace)
    if args.tier == "remote":
        text = (f"{verb} {plural(len(r.objects), 'remote object')} ({_human(r.bytes_freed)}) and "
                f"{len(r.temporary_files)} orphaned manifests and stale locks")
    else:
        text = (f"{verb} {plural(len(r.objects), 'object')} ({_human(r.bytes_freed)}) and "
                f"{plural(len(r.temporary_files), 'temporary file')} of dead processes")
    return r.as_dict(), text, 0


def _common_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes, before or after the command's name.

    On the top-level parser (``suppress=False``) they carry the real defaults ($PARAMSTORE_*); on the
    copies each subcommand inherits (``suppress=True``) the default is SUPPRESS, so a subcommand sets
    only what is given after it (and that wins) and never resets what was given before it.
    """
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--json", action="store_true", default=default(False), help="print machine-readable JSON")
    parser.add_argument("--root", default=default(os.environ.get("PARAMSTORE_ROOT")),
                        help="store directory (default: $PARAMSTORE_ROOT)")
    parser.add_argument("--remote", metavar="URL", default=default(os.environ.get("PARAMSTORE_REMOTE")),
                        help="remote URL, e.g. s3://bucket/prefix (default: $PARAMSTORE_REMOTE)")
    parser.add_argument("--registry", metavar="URL", default=default(os.environ.get("PARAMSTORE_REGISTRY")),
                        help="registry shared by hosts, redis://[:password@]host:port/db (default: "
                             "$PARAMSTORE_REGISTRY; none: the LMDB registry in the root)")
    parser.add_argument("--name", default=default(os.environ.get("PARAMSTORE_NAME")),
                        help="the store's name in a shared registry (default: $PARAMSTORE_NAME)")


def _parser() -> argparse.ArgumentParser:
    # The common options are accepted before or after the command (see _common_options).
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, suppress=True)
    p = argparse.ArgumentParser(prog="paramstore", description="A versioned parameter store.")
    p.add_argument("--version", action="version", version=f"paramstore {__version__}")
    _common_options(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable, help: str,
            parent: argparse.ArgumentParser = common) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[parent])
        sp.set_defaults(fn=fn)
        return sp

    sp = add("ls", _ls, "list versions, their metrics and tags (and whether each is persisted to a remote)")
    sp.add_argument("--tier", choices=("local", "remote"), default="local",
                    help="remote: list the remote's versions instead")
    add("push", _push, "upload versions to the remote (default: every one not yet there); the first push "
        "makes the URL a remote").add_argument(
        "version", type=_version_arg, nargs="*", help="versions to upload: steps, 'latest' or tags (default: "
                                                      "every local version the remote lacks)")
    add("pull", _pull, "download a version from the remote, verified, into this store (created if missing)"
        ).add_argument("version", type=_version_arg, help="the remote's version: a step, 'latest' or a tag")
    add("show", _show, "show a version and its tensors").add_argument(
        "version", type=_version_arg, help=_VERSION_HELP)
    sp = add("diff", _diff, "compare two versions: tensors changed, added, removed; bytes; max |Δ|")
    sp.add_argument("a", type=_version_arg, help="the older version: " + _VERSION_HELP)
    sp.add_argument("b", type=_version_arg, help="the newer version: " + _VERSION_HELP)
    sp = add("verify", _verify, "rehash objects; report corruption (exit 1), orphans and leftovers")
    sp.add_argument("version", type=_version_arg, nargs="?", help="the version to check (default: every one)")
    sp.add_argument("--repair", action="store_true",
                    help="move damaged objects to ROOT/quarantine/ (kept; no longer used for dedup) and fetch "
                         "good copies from peers or the remote (--remote URL); exit 1 if versions stay damaged")
    add("rm", _rm, "remove a version that cannot be repaired (refused while leased, and for the latest); "
        "its objects go at the next gc").add_argument("version", type=_version_arg, help=_VERSION_HELP)
    add("du", _du, "logical vs stored bytes and the dedup ratio")
    sp = add("export", _export, "write a version as a Hugging Face model directory (safetensors shards, index, "
             "config and tokenizer files) that from_pretrained loads as it is")
    sp.add_argument("version", type=_version_arg, help=_VERSION_HELP)
    sp.add_argument("dir", help="the directory to write (created if missing)")
    sp.add_argument("--shard-size-bytes", type=int, default=5 * 10**9, metavar="N",
                    help="largest safetensors shard, in bytes (default: 5e9, as transformers writes)")
    sp.add_argument("--assets-from", metavar="MODEL_DIR",
                    help="also write this directory's config and tokenizer files (for versions committed without them)")
    sp.add_argument("--weights-only", action="store_true",
                    help="write the shards and index alone (no config: from_pretrained cannot load it as it is)")
    sp.add_argument("--recipe", metavar="NAME",
                    help="write the tensors as this recipe derives them (e.g. fp8-block128, fp8-tensor), with its "
                         "quantization_config in config.json")
    sp = add("tag", _tag, "point a tag at a version (tag VERSION NAME) or delete one (tag --delete NAME); "
             "as git tag, an existing tag is moved only with --force")
    sp.add_argument("version", type=_version_arg, nargs="?", help="the version to tag: a step, 'latest' or a tag")
    sp.add_argument("tag", metavar="NAME", help="the tag's name")  # not dest "name": that is --name, the store's
    sp.add_argument("--delete", action="store_true", help="delete tag NAME (its version stays)")
    sp.add_argument("-f", "--force", action="store_true", help="move NAME if it already points at another version")
    add("leases", _leases, "list live leases: which versions readers hold")
    sp = add("prune", _prune, "remove versions no keep flag keeps (flags compose: keep if any keeps); "
             "the latest, leased and tagged versions are always kept (tagged: unless --prune-tagged)")
    sp.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest versions")
    sp.add_argument("--keep-every", type=int, metavar="K", help="keep steps divisible by K")
    sp.add_argument("--keep-best", type=int, metavar="N", help="keep the N best by --metric")
    sp.add_argument("--metric", metavar="NAME", help="the metric --keep-best ranks by (as committed: metrics=)")
    sp.add_argument("--mode", choices=("max", "min"), default=None,
                    help="max: higher --metric is better; min: lower is. Needed unless the name says "
                         "(loss, error, perplexity...: min; reward, accuracy, score...: max)")
    sp.add_argument("--keep-tag", action="append", metavar="T",
                    help="keep versions tagged T (repeatable; every tagged version is kept anyway "
                         "unless --prune-tagged)")
    sp.add_argument("--prune-tagged", action="store_true",
                    help="tagged versions get no protection of their own: only --keep-tag and the "
                         "other keep flags keep them")
    sp.add_argument("--keep-within", metavar="DURATION", help="e.g. 2h, 30m, 1d12h (from the newest version)")
    sp.add_argument("--dry-run", action="store_true", help="show what would be removed, remove nothing")
    sp.add_argument("--tier", choices=("local", "remote"), default="local",
                    help="remote: prune the remote's versions (--remote URL) instead of this host's")
    sp = add("serve", _serve, "serve this host's objects to other hosts (Mooncake transfer engine; "
             "no authentication: private networks only), and/or the store's Prometheus metrics")
    sp.add_argument("--host", default=os.environ.get("PARAMSTORE_HOST", "127.0.0.1"),
                    help="address other hosts reach this one at (default: $PARAMSTORE_HOST or 127.0.0.1)")
    sp.add_argument("--metrics-port", type=int, metavar="N",
                    help="serve Prometheus metrics (paramstore_*, docs/api.md) at http://HOST:N/metrics "
                         "(needs paramstore[metrics]; without --registry: the metrics alone)")
    sp.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                    help="address the metrics are served at (default: 127.0.0.1)")
    sp = add("gc", _gc, "delete objects and temporary files no version references")
    sp.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    sp.add_argument("--tier", choices=("local", "remote"), default="local",
                    help="remote: collect the remote's objects (--remote URL) instead of this host's")
    sp.add_argument("--grace", type=float, metavar="SECONDS",
                    help="remote: spare unreferenced objects younger than this (default: the lock TTL, 600)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(args)


def _show_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    """Warnings (a root not on tmpfs, ...) as one line, like errors."""
    print(f"paramstore: warning: {message}", file=sys.stderr)


def _create(args: argparse.Namespace) -> bool | None:
    """Whether the command may create the store: ``serve`` does; ``pull`` (a write: restoring into a
    new root) and ``ls --tier remote`` (which reads the remote alone) leave it to the library (a root
    backed by a remote is made when first used); every other command reads a store that exists."""
    if args.command == "serve":
        return True
    if args.command == "pull" or (args.command == "ls" and args.tier == "remote"):
        return None
    return False


def _check_exists(root: str) -> None:
    """Refuse, with shell advice, a root that holds no store yet (missing or empty); other cases
    (a file, a directory of other files) are refused by the store with their own message."""
    path = os.path.abspath(root)
    if os.path.exists(os.path.join(path, MARKER)):
        return
    try:
        empty = not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))
    except OSError:
        return
    if empty:
        raise NotAStoreError(
            f"no store exists at {path} (no {MARKER}): check --root (or $PARAMSTORE_ROOT). A command never "
            "creates a store: its trainer's first commit does, or `paramstore --root "
            f"{path} --remote URL pull VERSION` restores one from a remote")


@contextlib.contextmanager
def _opened(args: argparse.Namespace, create: bool | None) -> Iterator[ParamStore]:
    """The store the command works on. Warnings raised while it opens are shown only once it is
    open: no "not on tmpfs" advice before an error that says no store is there."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            store = ParamStore(args.root, create=create, registry=args.registry, name=args.name,
                               remote=args.remote if _needs_remote(args) or _repairs(args) else None,
                               metrics=getattr(args, "metrics_port", None) is not None)
        except BaseException:
            for w in caught:
                if not _about_the_filesystem(w.message):
                    _show_warning(w.message, w.category)
            raise
    for w in caught:
        _show_warning(w.message, w.category)
    with store:
        yield store


def _about_the_filesystem(message: Warning | str) -> bool:
    """Whether a warning is the store's "root not on tmpfs" advice (see ``paramstore.store``)."""
    return isinstance(message, ParamStoreWarning) and "not tmpfs" in str(message)


def _steps_here(store: ParamStore) -> str:
    """Which steps the store holds, for a message about a version it lacks."""
    steps = [v.step for v in store.versions()]
    if not steps:
        return "the store has no version yet"
    if len(steps) <= 12:
        return f"steps here: {', '.join(map(str, steps))}"
    return (f"{len(steps)} versions here, steps {', '.join(map(str, steps[:3]))} ... "
            f"{', '.join(map(str, steps[-3:]))} (paramstore ls lists them)")


def _run(args: argparse.Namespace) -> int:
    if args.command == "tag" and args.delete and args.version is not None:
        if args.tag is not None and args.tag != args.version:
            print("paramstore: error: tag --delete takes one name", file=sys.stderr)
            return 2
        args.tag, args.version = args.version, None
    try:
        if not args.root:
            raise ParamStoreError("no store root: pass --root PATH or set PARAMSTORE_ROOT")
        if args.registry and not args.name:
            raise ParamStoreError("a shared registry needs --name (or $PARAMSTORE_NAME): the store's name")
        if _needs_remote(args) and not args.remote:
            raise ParamStoreError(f"{args.command} needs a remote: pass --remote URL or set PARAMSTORE_REMOTE")
        create = _create(args)
        if create is False:
            _check_exists(args.root)
        with _opened(args, create) as store:
            try:
                result, text, code = args.fn(store, args)
            except VersionNotFoundError as e:
                if isinstance(e, TagNotFoundError) or args.command == "pull" or getattr(args, "tier", "") == "remote":
                    raise
                raise VersionNotFoundError(f"{e}; {_steps_here(store)}") from None
    except (ParamStoreError, OSError) as e:  # registries raise the package's errors, never their backend's
        if args.json:
            print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        print(f"paramstore: error: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(result, indent=2) if args.json else text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


if __name__ == "__main__":
    sys.exit(main())
