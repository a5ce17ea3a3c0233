"""Save and load nested training state without pickle: tensors to safetensors, the rest to JSON.

Optimizer, scheduler, EMA and RNG states are trees of dicts, lists and tuples whose leaves
are tensors, numbers, strings, booleans or None. ``save_tree`` writes the tensors to
``<stem>.safetensors`` and the tree, with each tensor replaced by a reference, to
``<stem>.json``; ``load_tree`` rebuilds it. Loading never unpickles anything, so a
checkpoint cannot run code. Dict keys keep their type (optimizer state is keyed by int)
and tuples stay tuples; any other type is refused when saving, so nothing is silently lost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TENSOR, TUPLE, DICT, NDARRAY = "__tensor__", "__tuple__", "__dict__", "__ndarray__"


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        # an own copy: safetensors refuses tensors that share storage (e.g. views of flat buffers)
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR: name}
    if isinstance(value, np.ndarray):
        return {NDARRAY: _encode(torch.from_numpy(np.ascontiguousarray(value)), tensors, where)}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: dict key {key!r} is neither str nor int")
            items.append([key, _encode(item, tensors, f"{where}.{key}")])
        return {DICT: items}
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise TypeError(f"{where}: cannot save a {type(value).__name__} without pickle; convert it to plain data")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR in value:
        return tensors[value[TENSOR]]
    if NDARRAY in value:
        return _decode(value[NDARRAY], tensors).numpy()
    if TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[TUPLE])
    return {key: _decode(item, tensors) for key, item in value[DICT]}


def save_tree(stem: Path, tree: Any) -> list[Path]:
    """Write ``tree`` to ``stem.json`` (+ ``stem.safetensors`` when it holds tensors);
    returns the files written."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, stem.name)
    written = []
    if tensors:
        save_file(tensors, str(stem.with_suffix(".safetensors")))
        written.append(stem.with_suffix(".safetensors"))
    stem.with_suffix(".json").write_text(json.dumps({"tensors": bool(tensors), "tree": encoded}))
    written.append(stem.with_suffix(".json"))
    return written


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors and arrays in ``tree``: about what ``save_tree`` writes for it."""
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def load_tree(stem: Path) -> Any:
    """Rebuild what ``save_tree(stem, ...)`` wrote, tensors on the CPU."""
    document = json.loads(stem.with_suffix(".json").read_text())
    tensors = load_file(str(stem.with_suffix(".safetensors"))) if document["tensors"] else {}
    return _decode(document["tree"], tensors)
