"""Digests of arrays' bits, computed where the arrays are: the state fingerprint's arithmetic.

A job's end (and every exact-resume check) fingerprints the whole train state. Copying the state
to the host and hashing its bytes there costs most of a second a gigabyte on the training thread
(the 100M-parameter byte LM with AdamW's moments holds 1.1 GiB), and holds each array whole on
the host. Instead
each array is read as 32-bit words ``w[i]`` (16- and 8-bit items widened, 64-bit items split in
two, in C order) and summed in three lanes, modulo 2**32, each word scrambled with its index:

    h = i * 0x9E3779B1
    a = w * (h | 1)                                     (any one word changed changes the sum)
    b = (w ^ (h >> 7) ^ 0x85EBCA6B) * ((h ^ 0x27D4EB2F) | 1); b ^= b >> 13
    c = (rotl(w, 11) + h) * 0xC2B2AE3D; c ^= c >> 16

Integer sums do not depend on the order of the reduction, so the digest of an array is the same
on the host (numpy), on a GPU and sharded over any mesh. It is not a cryptographic hash: it tells
equal states from states that differ, which is what it is for. The same arithmetic in numpy
(`host_digest`, in cache-sized chunks: faster than SHA-256 over the bytes) and in JAX
(`device_digests`) is tested equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_GOLDEN = 0x9E3779B1
_SALT_B, _MUL_B = 0x85EBCA6B, 0x27D4EB2F
_MUL_C = 0xC2B2AE3D


def _lanes(xp, words, index):
    """The three lane sums of uint32 `words` whose C-order indices are `index` (uint32)."""
    u = xp.uint32
    h = index * u(_GOLDEN)
    a = words * (h | u(1))
    b = (words ^ (h >> u(7)) ^ u(_SALT_B)) * ((h ^ u(_MUL_B)) | u(1))
    b = b ^ (b >> u(13))
    c = (((words << u(11)) | (words >> u(21))) + h) * u(_MUL_C)
    c = c ^ (c >> u(16))
    return [xp.sum(lane, dtype=u) for lane in (a, b, c)]


_HOST_CHUNK = 1 << 18  # words: the temporaries of a chunk stay in the CPU's cache


def host_digest(array) -> bytes:
    """The digest of an array on the host (numpy, or anything `np.asarray` takes)."""
    flat = np.ascontiguousarray(np.asarray(array)).reshape(-1)
    if flat.dtype.itemsize in (1, 2):
        words = flat.view(f"u{flat.dtype.itemsize}")
    else:  # 4 bytes: one word; 8 (and 16): several, low word first (little-endian)
        words = flat.view(np.uint32)
    sums = np.zeros(3, np.uint32)
    for start in range(0, words.size, _HOST_CHUNK):
        chunk = words[start : start + _HOST_CHUNK].astype(np.uint32, copy=False)
        index = np.arange(chunk.size, dtype=np.uint32) + np.uint32(start % 2**32)
        sums += np.array(_lanes(np, chunk, index), dtype=np.uint32)
    return sums.astype("<u4").tobytes()


_jitted: dict[str, Any] = {}


def device_digests(arrays: list) -> list[bytes]:
    """The digests of jax arrays where they are (any sharding, over one process or several: then
    a collective, which every process calls with the same arrays): no copy of the arrays to the
    host, 12 bytes each back. Equal to `host_digest` of each. One small program per shape, dtype
    and sharding (a model's large arrays come in a few shapes), all dispatched before any is
    read (`collective.spanning_fingerprint` passes one array at a time)."""
    if not arrays:
        return []
    # Three scalars an array: a 0-d result is whole on every device, also when the array spans
    # several processes (each reads its own copy, after the sums' all-reduce).
    out = [_lanes_program()(x) for x in arrays]
    return [
        np.array([np.asarray(lane.addressable_data(0)) for lane in lanes], dtype="<u4").tobytes()
        for lanes in out
    ]


def precompile_digests(types) -> None:
    """Compile `device_digests`' programs for arrays of these types (``jax.ShapeDtypeStruct``
    with the arrays' own sharding: another spelling of it is another program), each once, so a
    later `device_digests` of such arrays compiles nothing."""
    for t in dict.fromkeys(types):
        _lanes_program().lower(t).compile()


def _lanes_program():
    import jax

    if "lanes" not in _jitted:
        _jitted["lanes"] = jax.jit(_device_lanes)
    return _jitted["lanes"]


def _device_lanes(x):
    import jax
    import jax.numpy as jnp

    size = x.dtype.itemsize
    if size == 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        raw = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
        words = jax.lax.bitcast_convert_type(raw, unsigned).astype(jnp.uint32)
    else:  # 8 bytes: the low word first, as numpy's view on a little-endian host
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # The C-order index from per-dimension iotas: no reshape, which could move a sharded array.
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[dim]
    return tuple(_lanes(jnp, words, index))


def device_digestible(leaf) -> bool:
    """Whether `device_digests` takes this leaf: a jax array of a dtype it reads as words."""
    import jax

    if not isinstance(leaf, jax.Array):
        return False
    kind = leaf.dtype.kind
    return kind in "biuf" or (kind == "V" and leaf.dtype.itemsize in (1, 2))  # (ml_dtypes' floats)
