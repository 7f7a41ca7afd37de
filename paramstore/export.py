"""Export a version in the Hugging Face layout: safetensors shards plus ``model.safetensors.index.json``.

The result loads with ``safetensors.torch.load_file`` (each shard) and with ``transformers``'
``from_pretrained(dir)``. Bytes are streamed from the store's objects into the shards: no torch, no
full copy in memory. Each file is written under a temporary name and renamed into place. Tied names
are written as separate tensors (safetensors cannot alias).
"""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import InvalidArgumentError
from .format import TensorSpec, layout
from .progress import progress
from .root import StoreRoot

__all__ = ["export", "INDEX_NAME", "DEFAULT_EXPORT_SHARD_BYTES"]

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_EXPORT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size


def export(root: StoreRoot, step: int, directory: str, *, shard_size_bytes: int = DEFAULT_EXPORT_SHARD_BYTES,
           show_progress: bool = True) -> dict[str, Any]:
    """Write version ``step`` to ``directory`` as HF-style shards; returns what was written.

    Raises InvalidArgumentError if ``directory`` already holds an export (or is a file).
    """
    if shard_size_bytes <= 0:
        raise InvalidArgumentError(f"shard size must be positive, got {shard_size_bytes}")
    with root.leased([step]):  # retention cannot prune it while its bytes are copied
        return _export(root, step, directory, shard_size_bytes, show_progress)


def _export(root: StoreRoot, step: int, directory: str, shard_size_bytes: int, show_progress: bool) -> dict[str, Any]:
    version = root.registry.get_version(step)
    man = root.registry.get_manifest(step)
    if os.path.exists(os.path.join(directory, INDEX_NAME)) or (os.path.exists(directory) and not os.path.isdir(directory)):
        raise InvalidArgumentError(f"{directory} already holds an export or is not a directory")
    os.makedirs(directory, exist_ok=True)

    names = man.names()
    shards: list[list[str]] = [[]]
    filled = 0
    for n in names:
        size = man.entry(n).nbytes
        if shards[-1] and filled + size > shard_size_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(n)
        filled += size
    count = len(shards)
    files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    maps = {o: root.tier.map(o, private=False) for o in man.objects()}
    weight_map: dict[str, str] = {}
    try:
        with progress(man.nbytes + sum(man.entry(a).nbytes for a in man.aliases), f"export {step}",
                      enabled=None if show_progress else False) as bar:
            for fname, group in zip(files, shards):
                plan = layout([TensorSpec(n, man.entry(n).dtype, man.entry(n).shape) for n in group])
                tmp = os.path.join(directory, fname + ".partial")
                with open(tmp, "wb") as f:
                    f.write(plan.header)
                    for p in plan.placements:
                        n = p.spec.name
                        e = man.entry(n)
                        with memoryview(maps[e.object]) as mv:
                            f.write(mv[e.offset : e.offset + e.nbytes])
                        bar.update(e.nbytes)
                        weight_map[n] = fname
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(directory, fname))
    finally:
        for m in maps.values():
            m.close()
    index = {
        "metadata": {"total_size": sum(man.entry(n).nbytes for n in names), "paramstore_step": step,
                     "paramstore_digest": version.digest},
        "weight_map": weight_map,
    }
    tmp = os.path.join(directory, INDEX_NAME + ".partial")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2)
    os.replace(tmp, os.path.join(directory, INDEX_NAME))  # written last: the export is complete
    return {"step": step, "directory": os.path.abspath(directory), "files": [*files, INDEX_NAME],
            "total_size": index["metadata"]["total_size"]}
