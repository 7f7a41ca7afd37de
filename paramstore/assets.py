"""Assets: the small files a version's weights need to be loaded by a framework.

A Hugging Face model directory is the weights *and* ``config.json`` (which model, what sizes),
``generation_config.json`` and the tokenizer's files. A version keeps such files as *assets*
(stored like tensors: :mod:`paramstore.manifest`), so that ``paramstore export`` writes a directory
that ``from_pretrained`` and ``vllm.LLM(model=...)`` load as it is.

Where assets come from:

- a commit of a transformers ``PreTrainedModel`` keeps its ``config.json`` and (for a model that
  generates) ``generation_config.json``, as ``save_pretrained`` writes them
  (:func:`model_assets`; transformers is never imported here: the model is recognised by its
  ``config``);
- ``store.commit(..., assets=DIR_or_mapping)`` attaches others (:func:`read_assets`);
- ``export(..., assets_from=DIR)`` adds files at export time, for versions committed without them.

No pickle and no code: assets are bytes, written out as they came in.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from typing import Any, Mapping, Union

from .errors import InvalidArgumentError, ParamStoreWarning
from .text import warn
from .safefs import create_new, read_regular
from .validate import REFUSED_ASSET_SUFFIXES, check_asset_name

__all__ = ["AssetsArg", "read_assets", "dir_assets", "model_assets", "check_loadable", "write_assets",
           "WEIGHT_SUFFIXES", "MAX_ASSET_BYTES"]

#: What ``assets=`` takes: a directory, or a mapping of file names to bytes (the content) or paths.
AssetsArg = Union[str, "os.PathLike[str]", Mapping[str, Union[bytes, str, "os.PathLike[str]"]], None]

#: Files of a model directory that are weights, not assets: the store holds the weights itself.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz", ".onnx",
                   ".ot", ".tflite", ".pdparams", ".pkl", ".pickle", ".index.json")

#: The largest asset file read (a tokenizer is a few MB): a FIFO or a huge file is not read whole.
MAX_ASSET_BYTES = 64 << 20

_CONFIG = "config.json"
#: model -> (what its config files were made from, the files): see :func:`model_assets`.
_MADE: "weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, bytes]]]" = weakref.WeakKeyDictionary()


def read_assets(assets: AssetsArg) -> dict[str, bytes]:
    """The files ``assets`` names, as name -> bytes.

    ``assets`` is a directory (:func:`dir_assets`: every file at its top except weights), or a
    mapping of file names to their content (``bytes``) or to a file to read (a path, ``str`` or
    ``os.PathLike``), or None (no assets).

    Raises:
        InvalidArgumentError: not a directory or a mapping, a file that cannot be read, an empty
            directory.
        InvalidNameError: a name that is not a plain file name, or is one an export writes itself.

    Example:
        >>> read_assets({"chat_template.jinja": b"{{ messages }}"})
        {'chat_template.jinja': b'{{ messages }}'}
    """
    if assets is None:
        return {}
    if isinstance(assets, (str, os.PathLike)):
        return dir_assets(assets)
    if not isinstance(assets, Mapping):
        raise InvalidArgumentError(f"assets must be a directory or a mapping of file names to bytes or paths, "
                                   f"got {type(assets).__name__}")
    out = {}
    for name, value in assets.items():
        check_asset_name(name)
        if isinstance(value, (bytes, bytearray, memoryview)):
            out[name] = bytes(value)
        elif isinstance(value, (str, os.PathLike)):
            out[name] = _read(value)
        else:
            raise InvalidArgumentError(f"asset {name!r} must be bytes (the content) or a path, got {type(value).__name__}")
    return out


def dir_assets(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every regular file at the top of ``directory`` that is not weights (:data:`WEIGHT_SUFFIXES`),
    code or pickles (``*.py``, ``*.so``, ``*.bin``...: never stored) nor hidden, as name -> bytes: a
    model directory's configs, tokenizer and templates. Subdirectories are not entered.

    A symbolic link is followed only to a file inside ``directory``, or, for a Hugging Face cache
    snapshot (``models--*/snapshots/REV/``), inside that model's ``blobs/``: a link planted to
    ``~/.aws/credentials`` or ``/proc/self/environ`` is skipped with a warning, never read. Each file
    is at most :data:`MAX_ASSET_BYTES`. Raises InvalidArgumentError if there is no asset file."""
    path = os.fspath(directory)
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"assets directory {path!r} does not exist or is not a directory")
    out, skipped = {}, []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name.endswith(WEIGHT_SUFFIXES) or not entry.is_file():
            continue
        if entry.name.endswith(REFUSED_ASSET_SUFFIXES):
            skipped.append(entry.name)
            continue
        target = _inside(path, entry)
        if target is None:
            warn(f"paramstore: {entry.path} links outside {path}: not read as an asset", ParamStoreWarning)
            continue
        out[check_asset_name(entry.name)] = read_regular(target, limit=MAX_ASSET_BYTES)
    if skipped:
        warn(f"paramstore: {path}: code and pickle files are never kept as assets: {', '.join(skipped)} skipped",
             ParamStoreWarning)
    if not out:
        raise InvalidArgumentError(f"{path} holds no asset files (config, tokenizer...): only weights, "
                                   "subdirectories or hidden files")
    return out


def model_assets(model: Any, dtype: Any = None) -> dict[str, bytes]:
    """``config.json`` and ``generation_config.json`` of a transformers ``PreTrainedModel``, as
    its ``save_pretrained`` writes them (``architectures`` set to the model's class, ``dtype`` to
    the dtype the weights are stored in: ``dtype`` when the commit casts, else the model's); {} for
    anything else. A wrapper (``torch.compile``, DDP, FSDP1) is looked through for the class. The
    model's own config is not changed. A config that cannot be written as JSON gives a warning and
    no files (the commit goes on without them). The files are made once per model and config:
    serialising a config costs ~1 ms, on the trainer's thread, at every commit otherwise."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)) or not getattr(config, "model_type", None):
        return {}
    inner = _unwrapped(model)
    generation = getattr(inner, "generation_config", None)
    stored = dtype if dtype is not None else getattr(inner, "dtype", None)
    try:  # what the files are made of: a commit of the same model with an unchanged config reuses them
        key: Any = (str(stored), type(inner).__name__, copy.deepcopy(vars(config)),
                    copy.deepcopy(vars(generation)) if generation is not None else None)
        made = _MADE.get(model)
        if made is not None and made[0] == key:
            return dict(made[1])
    except Exception:  # noqa: BLE001 - a config that cannot be copied or compared: made afresh below
        key = None
    try:
        config = copy.deepcopy(config)
        config.architectures = [type(inner).__name__.removeprefix("FSDP")]
        if stored is not None:  # "float32", as save_pretrained records it (transformers 4.x: torch_dtype)
            setattr(config, "dtype" if "dtype" in vars(config) else "torch_dtype", str(stored).rsplit(".", 1)[-1])
        out = {_CONFIG: config.to_json_string(use_diff=True).encode()}
        can_generate = getattr(inner, "can_generate", lambda: False)
        if callable(getattr(generation, "to_json_string", None)) and can_generate():
            out["generation_config.json"] = generation.to_json_string(use_diff=True).encode()
    except Exception as e:  # noqa: BLE001 - a config transformers itself could not save: warn, commit the weights
        warn(f"paramstore: the model's config cannot be written as config.json ({type(e).__name__}: {e}); "
             "the version is committed without it (export it with assets_from=MODEL_DIR)", ParamStoreWarning)
        return {}
    if key is not None:
        _MADE[model] = (key, out)
    return dict(out)


def _inside(directory: str, entry: os.DirEntry) -> str | None:
    """The file ``entry`` (of ``directory``) names: itself, or, for a link, its target when that lies
    inside ``directory`` or in a Hugging Face cache entry's ``blobs/``; None for a link elsewhere."""
    if not entry.is_symlink():
        return entry.path
    home = os.path.realpath(directory)
    target = os.path.realpath(entry.path)
    roots = [home]
    snapshots = os.path.dirname(home)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(os.path.dirname(snapshots)).startswith("models--"):
        roots.append(os.path.join(os.path.dirname(snapshots), "blobs"))
    return target if any(target.startswith(r + os.sep) for r in roots) else None


def _unwrapped(model: Any) -> Any:
    """The model a wrapper holds (``torch.compile``'s ``_orig_mod``, DDP's and FSDP1's ``module``)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or inner is model or not hasattr(inner, "config"):
            return model
        model = inner


def check_loadable(assets: Mapping[str, bytes], where: str) -> None:
    """Raise InvalidArgumentError unless ``assets`` make an export loadable by ``from_pretrained``:
    a ``config.json`` that is a JSON object with a ``model_type`` (without it transformers cannot
    tell which model to build, or silently builds a default-size one). ``where`` names the export."""
    how = ("commit a transformers model (its config is kept), commit with assets=MODEL_DIR, export with "
           "assets_from=MODEL_DIR (CLI: --assets-from), or export the weights alone with weights_only=True "
           "(CLI: --weights-only)")
    if _CONFIG not in assets:
        raise InvalidArgumentError(f"{where} would not load with from_pretrained: the version has no config.json; {how}")
    try:
        config = json.loads(assets[_CONFIG])
    except ValueError as e:
        raise InvalidArgumentError(f"{where}: its config.json is not JSON ({e}); {how}") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise InvalidArgumentError(f"{where} would not load with from_pretrained: its config.json has no model_type; "
                                   f"{how}")


def write_assets(directory: str, assets: Mapping[str, bytes]) -> list[str]:
    """Write each asset into ``directory`` (under a temporary name, fsynced, then renamed);
    returns the names written."""
    for name, data in sorted(assets.items()):
        check_asset_name(name)
        tmp = os.path.join(directory, name + ".partial")
        with create_new(tmp) as f:  # never through a link planted there
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    return sorted(assets)


def _read(path: str | os.PathLike[str]) -> bytes:
    """An asset file the caller named by path: followed if a link (the caller chose it), but a
    regular file of at most :data:`MAX_ASSET_BYTES`."""
    return read_regular(os.path.realpath(os.fspath(path)), limit=MAX_ASSET_BYTES)
