"""Layer states sent between pipeline ranks (distributed.py): what a session file needs from
the ranks that hold the later stages, and what they get back when one is restored.

A message is three sends to one peer: two int32s (the JSON description's bytes, the number of
arrays), the description as uint8, then each array. The description names every array's dtype
and shape, so the receiver knows what to expect, and any other JSON the caller adds. States
are encoded as sessions store them (serve/session.py): per layer, each slot is an array (by
index, so an array several snapshots share is sent once), an int or None.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import mlx.core as mx
import numpy as np


def encode_states(states: Sequence[tuple], arrays: list[mx.array], index: dict[int, int]) -> list[list]:
    """Per layer, each slot as {"a": array index} (appending new arrays to `arrays`), {"i": n} or None."""
    encoded = []
    for i, state in enumerate(states):
        slots = []
        for j, value in enumerate(state):
            if isinstance(value, mx.array):
                if id(value) not in index:
                    index[id(value)] = len(arrays)
                    arrays.append(value)
                slots.append({"a": index[id(value)]})
            elif isinstance(value, int) and not isinstance(value, bool):
                slots.append({"i": value})
            elif value is None:
                slots.append(None)
            else:
                raise TypeError(f"layer {i} slot {j}: cannot send a {type(value).__name__}")
        encoded.append(slots)
    return encoded


def decode_states(encoded: list[list], arrays: Sequence[mx.array]) -> list[tuple]:
    """`encode_states`'s form back to per-layer slot tuples."""
    return [tuple(None if slot is None else arrays[slot["a"]] if "a" in slot else slot["i"] for slot in layer)
            for layer in encoded]


def send_message(description: dict, arrays: Sequence[mx.array], peer: int, group) -> None:
    """Send `description` (JSON) and `arrays` to `peer`; returns once all of it has left."""
    arrays = [mx.contiguous(a) for a in arrays]
    body = json.dumps({**description, "arrays": [[str(a.dtype).rsplit(".", 1)[-1], list(a.shape)] for a in arrays]})
    data = np.frombuffer(body.encode(), dtype=np.uint8)
    mx.eval(mx.distributed.send(mx.array([len(data), len(arrays)], dtype=mx.int32), peer, group=group))
    mx.eval(mx.distributed.send(mx.array(data), peer, group=group))
    for a in arrays:
        if a.size:  # empty arrays are made again from their shape
            mx.eval(mx.distributed.send(a, peer, group=group))


def recv_message(peer: int, group) -> tuple[dict, list[mx.array]]:
    """What `send_message` sent from `peer`: the description and the arrays, evaluated."""
    sizes = mx.distributed.recv((2,), mx.int32, peer, group=group)
    mx.eval(sizes)
    length, count = sizes.tolist()
    data = mx.distributed.recv((length,), mx.uint8, peer, group=group)
    mx.eval(data)
    description = json.loads(bytes(np.array(data)).decode())
    specs = description.pop("arrays")
    if len(specs) != count:
        raise ValueError(f"a message of {count} arrays describes {len(specs)}")
    arrays = []
    for dtype, shape in specs:
        dtype = getattr(mx, dtype)
        if np.prod(shape, dtype=np.int64):
            a = mx.distributed.recv(tuple(shape), dtype, peer, group=group)
            mx.eval(a)  # in order: the next receive's bytes follow this one's
        else:
            a = mx.zeros(tuple(shape), dtype=dtype)
        arrays.append(a)
    return description, arrays
