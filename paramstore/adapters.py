"""LoRA adapter versions: an adapter's weights committed as a version linked to a base version.

Many RL runs train a LoRA adapter only. ``store.commit(step, adapter, base=version)`` stores just
the adapter (its tensors under the names PEFT saves them with, and its ``adapter_config.json`` as an
asset) as an ordinary version whose metadata names the base (:data:`BASE_KEY`: its step and
digest). ``adapter`` is a PEFT model (its active adapter's weights and config are taken, as
``save_pretrained`` would write them) or a state dict with ``adapter_config=`` (a mapping, a PEFT
config object, or the path of an ``adapter_config.json``).

Lifetimes: the base lives as long as an adapter version that names it. Retention keeps the base of
every version it keeps (:func:`paramstore.retention.decide`, reason ``"base of adapter version
N"``); the commit holds a lease on the base until the adapter version is visible, so a prune that
runs meanwhile either sees the adapter version or finds the base leased. Moving an adapter moves
only its own bytes (content addressing: unchanged adapter tensors are not stored or sent again).

:func:`write_peft` writes an adapter directory that ``peft.PeftModel.from_pretrained`` loads
(``adapter_config.json`` and ``adapter_model.safetensors``); ``paramstore export`` of an adapter
version writes one.

Example:
    >>> adapter = adapter_of({"base_model.model.0.lora_A.weight": torch.ones(2, 4),
    ...                       "base_model.model.0.lora_B.weight": torch.zeros(4, 2)},
    ...                      {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["0"]})
    >>> sorted(adapter.tensors), adapter.config["r"]
    (['base_model.model.0.lora_A.weight', 'base_model.model.0.lora_B.weight'], 2)
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .errors import InvalidArgumentError
from .safefs import read_regular, write_atomic

if TYPE_CHECKING:
    import torch

__all__ = ["Adapter", "adapter_of", "base_of", "config_bytes", "write_peft", "BASE_KEY", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]

#: The metadata key of an adapter version: ``{"step": base step, "digest": base version digest}``.
BASE_KEY = "paramstore.adapter_base"
#: PEFT's file names in an adapter directory.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Adapter:
    """An adapter as a commit stores it: its tensors (PEFT's saved names) and its config."""

    tensors: "dict[str, torch.Tensor]"
    config: dict[str, Any]


def adapter_of(adapter: Any, adapter_config: Any = None) -> Adapter:
    """The tensors and config of ``adapter``: a PEFT model (its active adapter; ``adapter_config``
    must then be None) or a mapping of names to tensors with ``adapter_config``.

    Raises:
        InvalidArgumentError: neither form, no tensors, a non-tensor value, or a config without
            ``peft_type`` (and, for LoRA, without a positive int ``r`` or ``target_modules``).
    """
    import torch  # here: retention and the CLI read adapter metadata without loading torch

    if hasattr(adapter, "peft_config") and not isinstance(adapter, Mapping):
        if adapter_config is not None:
            raise InvalidArgumentError("a PEFT model carries its own config: pass adapter_config= only with a state dict")
        from peft.utils import get_peft_model_state_dict

        name = adapter.active_adapter
        if not isinstance(name, str):
            raise InvalidArgumentError(f"the PEFT model has several active adapters {name!r}: commit one at a time")
        tensors = dict(get_peft_model_state_dict(adapter, adapter_name=name))
        config = adapter.peft_config[name].to_dict()
    elif isinstance(adapter, Mapping):
        if adapter_config is None:
            raise InvalidArgumentError("an adapter given as a state dict needs adapter_config= (a mapping, a PEFT "
                                       "config or the path of an adapter_config.json)")
        tensors, config = dict(adapter), _config_of(adapter_config)
    else:
        raise InvalidArgumentError(f"an adapter is a PEFT model or a state dict, got {type(adapter).__name__}")
    if not tensors:
        raise InvalidArgumentError("the adapter has no tensors")
    bad = sorted(k for k, v in tensors.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise InvalidArgumentError(f"adapter entries must be tensors; {bad[0]!r} is not")
    return Adapter(tensors, _check_config(config))


def _config_of(value: Any) -> dict[str, Any]:
    if isinstance(value, (str, os.PathLike)):
        raw = read_regular(os.fspath(value), limit=_MAX_CONFIG_BYTES)
        try:
            loaded = json.loads(raw)
        except ValueError as e:
            raise InvalidArgumentError(f"{os.fspath(value)}: not JSON ({e})") from e
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(f"{os.fspath(value)}: an adapter config is a JSON object")
        return loaded
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    raise InvalidArgumentError(f"adapter_config must be a mapping, a PEFT config or a path, got {type(value).__name__}")


def _plain(value: Any) -> Any:
    """JSON form of a PEFT config value (sets sorted to lists, enums to their values)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    plain = _plain(config)
    try:
        json.dumps(plain)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"the adapter config is not JSON-serializable ({e})") from e
    kind = plain.get("peft_type")
    if not isinstance(kind, str):
        raise InvalidArgumentError("the adapter config has no peft_type (e.g. \"LORA\")")
    if kind == "LORA":
        r = plain.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise InvalidArgumentError(f"a LoRA config needs a positive int r, got {r!r}")
        if not plain.get("target_modules"):
            raise InvalidArgumentError("a LoRA config needs target_modules")
    plain["inference_mode"] = True  # as PEFT's save_pretrained writes it
    return plain


def config_bytes(config: Mapping[str, Any]) -> bytes:
    """``adapter_config.json`` as stored and exported: sorted keys, so equal configs are equal bytes."""
    return json.dumps(config, indent=2, sort_keys=True).encode()


def base_of(metadata: Mapping[str, Any]) -> int | None:
    """The base step an adapter version's ``metadata`` names (None: not an adapter version).

    Example:
        >>> base_of({BASE_KEY: {"step": 3, "digest": "ab" * 32}}), base_of({})
        (3, None)
    """
    base = metadata.get(BASE_KEY)
    if isinstance(base, Mapping) and isinstance(base.get("step"), int) and not isinstance(base.get("step"), bool):
        return base["step"]
    return None


def write_peft(directory: str, tensors: "Mapping[str, torch.Tensor]", config: bytes) -> list[str]:
    """Write an adapter directory PEFT loads: ``adapter_model.safetensors`` (``tensors``) and
    ``adapter_config.json`` (``config``, its bytes). ``directory`` is created if missing; each file
    is replaced atomically (:func:`paramstore.safefs.write_atomic`: a link planted there is never
    followed). Returns the files written."""
    from safetensors.torch import save

    os.makedirs(directory, exist_ok=True)
    weights = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    for name, data in ((ADAPTER_WEIGHTS, weights), (ADAPTER_CONFIG, config)):
        write_atomic(os.path.join(directory, name), data)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
