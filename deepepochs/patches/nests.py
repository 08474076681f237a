"""Nests of tensors as patches hold them: tuples, lists, dicts, namedtuples and attrs records of tensors.

What a patch needs of a batch's predictions and targets without knowing their structure: map every tensor
(detach, move), find the first one (its device, its batch length), count the bytes they take, and join the
batches of a :class:`~deepepochs.patches.TensorPatch` along dim 0. Nothing here forces a host-device sync.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["_concat", "_first_tensor", "_is_catable", "_map_tensors", "_nbytes"]


def _map_tensors(fn, obj):
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and attrs records; keep other leaves."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(fn, value) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes positional fields
        return type(obj)(*(_map_tensors(fn, value) for value in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(fn, value) for value in obj)
    if attrs.has(type(obj)):
        fields = [f for f in attrs.fields(type(obj)) if f.init]
        return attrs.evolve(obj, **{f.alias: _map_tensors(fn, getattr(obj, f.name)) for f in fields})
    return obj


def _first_tensor(obj, min_dim: int = 0) -> torch.Tensor | None:
    """The first tensor with at least ``min_dim`` dimensions in a nest, depth first, or None."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() >= min_dim else None
    if attrs.has(type(obj)):
        obj = [getattr(obj, f.name) for f in attrs.fields(type(obj))]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return next((t for t in (_first_tensor(v, min_dim) for v in values) if t is not None), None)


def _nbytes(obj) -> int:
    sizes = []
    _map_tensors(lambda t: sizes.append(t.numel() * t.element_size()), obj)
    return sum(sizes)


def _is_catable(obj) -> bool:
    """Whether concatenated batches keep this structure (only tensors with a dim 0, and Nones)."""
    if isinstance(obj, (dict, tuple, list)):
        return all(_is_catable(value) for value in (obj.values() if isinstance(obj, dict) else obj))
    return obj is None or (isinstance(obj, torch.Tensor) and obj.dim() >= 1)


def _concat(batches: list):
    """Concatenate batches leaf-wise along dim 0.

    Tensors are concatenated (0-d ones stacked); tuples, lists and dicts holding tensors are concatenated
    item by item; a list of plain values (one string or number per sample) is joined into one list; any
    other leaf becomes the list of its per-batch values.
    """
    first = batches[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.stack(batches) if first.dim() == 0 else torch.cat(batches)
    if isinstance(first, dict):
        if any(not isinstance(batch, dict) or batch.keys() != first.keys() for batch in batches):
            raise ValueError(f"TensorPatch batches must all be dicts with the keys {list(first)}")
        return {key: _concat([batch[key] for batch in batches]) for key in first}
    if isinstance(first, (tuple, list)) and all(
        v is None or isinstance(v, (torch.Tensor, tuple, list, dict)) for v in first
    ):
        if any(not isinstance(batch, (tuple, list)) or len(batch) != len(first) for batch in batches):
            raise ValueError(f"TensorPatch batches must all be sequences of {len(first)} items")
        parts = [_concat([batch[i] for batch in batches]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if isinstance(first, (tuple, list)):
        return [value for batch in batches for value in batch]
    return list(batches)
