"""Export a version in the Hugging Face layout: safetensors shards plus ``model.safetensors.index.json``,
and the version's assets (``config.json``, ``generation_config.json``, tokenizer files) beside them.

The result loads with ``safetensors.torch.load_file`` (each shard) and, as it is, with ``transformers``'
``from_pretrained(dir)`` and ``vllm.LLM(model=dir)``: every shard's header says ``{"format": "pt"}``
(transformers 4.x refuses shards without it), and the export is refused, before anything is written,
when it would not load: without a ``config.json`` naming its ``model_type`` (see
:func:`paramstore.assets.check_loadable`; ``assets_from=`` supplies the files of a version committed
without them, ``weights_only=True`` exports the weights alone). Bytes are streamed from the store's
objects into the shards: no full copy in memory. Each file is written under a temporary name and
renamed into place; the index last, so a directory with an index is a complete export.

A chunked tensor (a sharded commit: each rank stored its own block) is exported whole: its range of
the shard file is mapped and each chunk is copied into its box there (as a checkout reads a box), so no
tensor is ever assembled in memory. Only then is torch imported; a version without chunked tensors
is exported without it.

Tied weights (names that shared one storage at commit: the manifest's aliases) are written once,
under the name the store keeps for the group (the smallest name), and only that name is in the
index's ``weight_map``; the index's ``metadata.paramstore_aliases`` maps each tied name left out to
it. This is what ``save_pretrained`` does too (safetensors cannot alias; it writes one name of a
tied group and ``from_pretrained`` re-ties the others), though it may keep another name of the
group: for GPT-2 it keeps ``transformer.wte.weight`` where the store keeps ``lm_head.weight``.
``from_pretrained`` loads either (transformers 5 checked), for a model that ties these weights
(``tie_word_embeddings``). A loader that does not re-tie (``load_file`` then ``load_state_dict``)
must copy the tied names from ``paramstore_aliases``.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import IO, Any, Iterable, Mapping

from .adapters import ADAPTER_CONFIG, base_of, write_peft
from .assets import check_loadable, dir_assets, write_assets
from .derived import derive_manifest, resolve_recipe
from .errors import InvalidArgumentError, ObjectUnavailableError
from .format import TensorSpec, layout
from .manifest import TensorEntry
from .progress import progress
from .root import StoreRoot
from .safefs import check_own_directory, create_new
from .validate import EXPORT_INDEX

__all__ = ["export", "map_objects", "INDEX_NAME", "DEFAULT_EXPORT_SHARD_BYTES"]

INDEX_NAME = EXPORT_INDEX
DEFAULT_EXPORT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
#: Each exported shard's safetensors metadata: transformers 4.x refuses shards without ``format``.
EXPORT_METADATA = {"format": "pt"}


def export(root: StoreRoot, step: int, directory: str, *, shard_size_bytes: int = DEFAULT_EXPORT_SHARD_BYTES,
           show_progress: bool | None = None, assets_from: str | os.PathLike[str] | None = None,
           weights_only: bool = False, recipe: Any = None) -> dict[str, Any]:
    """Write version ``step`` to ``directory`` as HF-style shards and its assets; returns what was
    written (``files``: the shards, the assets, then the index).

    ``directory`` must be new or empty (leftover ``*.partial`` files of an interrupted export are
    allowed) and, if it exists, this user's. Every file is created new there (a leftover or a link
    planted under its name is unlinked, never written through: :mod:`paramstore.safefs`). ``show_progress``: None shows a bar when stderr is a terminal. ``assets_from``: a
    model directory whose files (every file at its top except weights) are written too, over the
    version's own of the same name. ``weights_only``: write the shards and the index only (no
    assets, no check that ``from_pretrained`` could load the result).
    ``recipe`` (a :mod:`paramstore.recipes` name or recipe): the tensors as the recipe derives them
    (:mod:`paramstore.derived`: derived objects made now if no earlier checkout made them), and the
    recipe's ``quantization_config`` merged into ``config.json`` (a ``quantization_config`` already
    there is replaced); the index's metadata names the recipe (``paramstore_recipe``).
    An *adapter version* (:mod:`paramstore.adapters`) is written as the directory PEFT loads
    (``adapter_config.json``, ``adapter_model.safetensors``), with none of those options.

    Raises:
        InvalidArgumentError: ``directory`` is a file or holds anything else; a bad shard size; the
            export would not load with ``from_pretrained`` (no ``config.json`` with a ``model_type``)
            and ``weights_only`` is false. Nothing is written then.
        ObjectUnavailableError: an object of the version is missing from this host (nothing is written).
    """
    if isinstance(shard_size_bytes, bool) or not isinstance(shard_size_bytes, int) or shard_size_bytes <= 0:
        raise InvalidArgumentError(f"shard_size_bytes must be a positive int, got {shard_size_bytes!r}")
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise InvalidArgumentError(f"{directory} is a file; export needs a new or empty directory")
        check_own_directory(directory)
        other = [f for f in os.listdir(directory) if not f.endswith(".partial")]
        if other:
            raise InvalidArgumentError(f"{directory} is not empty ({len(other)} entries, e.g. {sorted(other)[0]!r}); "
                                       "export needs a new or empty directory")
    if weights_only and assets_from is not None:
        raise InvalidArgumentError("weights_only exports no assets: pass assets_from= or weights_only=True, not both")
    if recipe is not None:
        recipe = resolve_recipe(recipe)
    extra = {} if assets_from is None else dir_assets(assets_from)
    with root.leased([step]):  # retention cannot prune it while its bytes are copied
        if base_of(root.registry.get_version(step).metadata) is not None:
            if recipe is not None or weights_only or assets_from is not None:
                raise InvalidArgumentError(f"version {step} is an adapter version, exported as a PEFT adapter "
                                           "directory: recipe, weights_only and assets_from do not apply")
            return _export_adapter(root, step, directory)
        return _export(root, step, directory, shard_size_bytes, show_progress, extra, weights_only, recipe)


def _export_adapter(root: StoreRoot, step: int, directory: str) -> dict[str, Any]:
    """An adapter version as the directory PEFT writes and loads (:func:`paramstore.adapters.write_peft`)."""
    import torch

    from .tensors import ST_TO_TORCH

    man = root.registry.get_manifest(step)
    maps = map_objects(root, step, man.objects())
    try:
        config = _bytes(maps, man.assets[ADAPTER_CONFIG])
        tensors = {}
        for name in sorted(man.tensors):
            e = man.entry(name)
            data = bytearray(_bytes(maps, e))  # a copy: the adapter is small
            tensors[name] = torch.frombuffer(data, dtype=ST_TO_TORCH[e.dtype]).reshape(e.shape) if data else \
                torch.empty(e.shape, dtype=ST_TO_TORCH[e.dtype])
        for alias, target in man.aliases.items():
            tensors[alias] = tensors[target]
    finally:
        for m in maps.values():
            m.close()
    files = write_peft(directory, tensors, config)
    return {"step": step, "directory": os.path.abspath(directory), "files": files,
            "total_size": sum(man.entry(n).nbytes for n in man.tensors)}


def _export(root: StoreRoot, step: int, directory: str, shard_size_bytes: int, show_progress: bool,
            extra: dict[str, bytes], weights_only: bool, recipe: Any = None) -> dict[str, Any]:
    version = root.registry.get_version(step)
    man = root.registry.get_manifest(step)
    if recipe is not None:
        for m in map_objects(root, step, man.objects()).values():  # ObjectUnavailableError before deriving
            m.close()
        man, _ = derive_manifest(root, man, recipe)
    wanted = {c.object for e in man.tensors.values() for c in e.pieces()} if weights_only else man.objects()
    maps = map_objects(root, step, wanted)  # before anything is written
    try:
        assets = {} if weights_only else {**{n: _bytes(maps, e) for n, e in man.assets.items()}, **extra}
        if not weights_only:
            check_loadable(assets, f"the export of version {step}")
            if recipe is not None:
                assets["config.json"] = with_quantization_config(assets["config.json"], recipe)
        os.makedirs(directory, exist_ok=True)
    except BaseException:
        for m in maps.values():
            m.close()
        raise

    names = sorted(man.tensors)  # not the aliases: a tied tensor is written once (module docstring)
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

    weight_map: dict[str, str] = {}
    try:
        with progress(man.nbytes, f"export {step}",
                      enabled=show_progress) as bar:
            for fname, group in zip(files, shards):
                plan = layout([TensorSpec(n, man.entry(n).dtype, man.entry(n).shape) for n in group],
                              EXPORT_METADATA)
                tmp = os.path.join(directory, fname + ".partial")
                with create_new(tmp) as f:  # readable too: a chunked tensor is assembled in a mapping of it
                    f.write(plan.header)
                    for p in plan.placements:
                        n = p.spec.name
                        e = man.entry(n)
                        if e.chunks:
                            _write_chunked(f, e, maps)
                        else:
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
    written = write_assets(directory, assets)
    index = {
        "metadata": {"total_size": sum(man.entry(n).nbytes for n in names), "paramstore_step": step,
                     "paramstore_digest": version.digest, "paramstore_aliases": dict(sorted(man.aliases.items())),
                     **({} if recipe is None else {"paramstore_recipe": f"{recipe.name}@{recipe.version}"})},
        "weight_map": weight_map,
    }
    tmp = os.path.join(directory, INDEX_NAME + ".partial")
    with create_new(tmp) as f:
        f.write(json.dumps(index, indent=2).encode())
    os.replace(tmp, os.path.join(directory, INDEX_NAME))  # written last: the export is complete
    return {"step": step, "directory": os.path.abspath(directory), "files": [*files, *written, INDEX_NAME],
            "total_size": index["metadata"]["total_size"]}


def with_quantization_config(config: bytes, recipe: Any) -> bytes:
    """``config.json``'s bytes with ``recipe``'s ``quantization_config`` set (replacing one there),
    the rest of it as it was.

    Example:
        >>> from paramstore import recipes
        >>> out = with_quantization_config(b'{"model_type": "llama"}', recipes.get("fp8-block128"))
        >>> json.loads(out)["quantization_config"]["weight_block_size"]
        [128, 128]
    """
    data = json.loads(config)
    data["quantization_config"] = recipe.config()
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _write_chunked(f: IO[bytes], entry: TensorEntry, maps: Mapping[str, mmap.mmap]) -> None:
    """Write the chunked tensor ``entry`` whole at the position of ``f`` (left just past it).

    The file is extended over the tensor's range, that range is mapped, and each chunk is copied
    from its object's map into its box there (:func:`paramstore.snapshot.copy_box`, as a checkout
    reads a box): the tensor is never assembled in memory. Same dtype on both sides: bit for bit.
    """
    import torch

    from .snapshot import copy_box
    from .tensors import ST_TO_TORCH

    dtype = ST_TO_TORCH[entry.dtype]
    f.flush()
    pos = f.tell()
    end = pos + entry.nbytes
    f.truncate(end)
    start = pos - pos % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page boundary
    with mmap.mmap(f.fileno(), end - start, offset=start) as out:
        whole = torch.frombuffer(out, dtype=torch.uint8)[pos - start :].view(dtype).view(entry.shape)
        copy_box(entry, lambda c: torch.frombuffer(maps[c.object], dtype=torch.uint8, offset=c.offset,
                                                   count=c.nbytes).view(dtype).view(c.sizes),
                 (0,) * len(entry.shape), entry.shape, whole)
        del whole
        out.flush()
    f.seek(end)


def _bytes(maps: Mapping[str, mmap.mmap], entry: TensorEntry) -> bytes:
    """The bytes of a whole (not chunked) entry: an asset's file."""
    return maps[entry.object][entry.offset : entry.offset + entry.nbytes]


def map_objects(root: StoreRoot, step: int, objects: Iterable[str]) -> dict[str, mmap.mmap]:
    """Maps of the objects of version ``step`` (the caller holds a lease and closes them).

    Copy-on-write, never written: writable, so torch can view them (a chunk's bytes), and the
    store's pages are shared. Raises ObjectUnavailableError, naming what to do, if one is missing
    from this host.
    """
    maps: dict[str, mmap.mmap] = {}
    try:
        for o in sorted(objects):
            maps[o] = root.tier.map(o, private=True)
    except FileNotFoundError:
        for m in maps.values():
            m.close()
        raise ObjectUnavailableError(f"version {step} references object {o[:12]}…, which is missing from this host: "
                                     "check the version out first (it fetches from peers or the remote), or run "
                                     "`paramstore verify` to see what is damaged") from None
    return maps
