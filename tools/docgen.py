"""Put a benchmark's generated Markdown into docs/benchmarks.md, between its markers.

Each benchmark that owns a table in the docs writes it with ``--markdown OUT``; this replaces the
block between ``<!-- BEGIN generated:NAME -->`` and ``<!-- END generated:NAME -->`` with the
content of OUT, so the table in the docs is the one the code produced, never retyped::

    .venv/bin/python tools/bench_core.py --gib 1 --markdown out/bench_core.md
    .venv/bin/python tools/docgen.py core out/bench_core.md

Prose around the block is the author's; the block itself says which run produced it.
"""

from __future__ import annotations

import argparse
import re
import sys

DOC = "docs/benchmarks.md"


def replace_block(doc: str, name: str, content: str) -> str:
    """``doc`` with the block named ``name`` replaced by ``content``. Raises KeyError if absent."""
    begin, end = f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(doc):
        raise KeyError(f"no block {name!r} in the document (add the markers {begin} ... {end})")
    return pattern.sub(lambda _: f"{begin}\n{content.strip()}\n{end}", doc, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the block's name, e.g. core")
    ap.add_argument("markdown", help="the generated Markdown file")
    ap.add_argument("--doc", default=DOC)
    args = ap.parse_args(argv)
    with open(args.markdown) as f:
        content = f.read()
    with open(args.doc) as f:
        doc = f.read()
    try:
        new = replace_block(doc, args.name, content)
    except KeyError as e:
        print(f"docgen: {e.args[0]}", file=sys.stderr)
        return 2
    with open(args.doc, "w") as f:
        f.write(new)
    print(f"docgen: {args.doc}: block {args.name!r} replaced from {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
