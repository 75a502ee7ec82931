"""The state fingerprint's digests: the same on the host, on a device and sharded over a mesh;
any changed bit, or two words swapped, changes them."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from process_helpers import json_on_cpu_devices

from prefect_jax.training import trees
from prefect_jax.training.digests import device_digestible, device_digests, host_digest
from prefect_jax.training.trees import state_fingerprint


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=(5, 7, 3), dtype=np.uint32)
    return [
        bits.view(np.float32),
        bits.view(np.int32)[1],
        bits[..., 0],
        bits.view(np.uint16).view(ml_dtypes.bfloat16),
        bits.view(np.float16)[:2],
        bits.view(np.int8),
        bits.view(np.uint8)[0, 0],
        bits[0, 0, :2] % 2 == 0,  # bool
        np.float32(1.5).reshape(()),  # 0-d
        np.zeros((0, 4), np.float32),  # empty
        rng.standard_normal(3 * 2**18 + 5).astype(np.float32),  # over several of the host's chunks
    ]


def test_host_and_device_digests_agree_for_each_dtype_and_shape():
    arrays = _arrays()
    on_device = [jnp.asarray(a) for a in arrays]
    assert all(device_digestible(a) for a in on_device)
    assert device_digests(on_device) == [host_digest(a) for a in arrays]
    assert not device_digestible(arrays[0])  # numpy: the host's


def test_a_changed_bit_or_two_swapped_words_change_the_digest():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint32)
    base = host_digest(words)
    for i, bit in [(0, 0), (17, 31), (4095, 5), (2048, 16)]:
        changed = words.copy()
        changed[i] ^= np.uint32(1 << bit)
        assert host_digest(changed) != base, (i, bit)
        assert device_digests([jnp.asarray(changed)]) == [host_digest(changed)]
    swapped = words.copy()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert host_digest(swapped) != base
    # The same bits as another dtype or shape are a different fingerprint (dtype and shape are
    # hashed with the digest).
    assert state_fingerprint({"w": words}) != state_fingerprint({"w": words.view(np.float32)})
    assert state_fingerprint({"w": words}) != state_fingerprint({"w": words.reshape(64, 64)})


def test_digests_compiled_ahead_from_the_states_types_compile_nothing_at_the_fingerprint(
    monkeypatch, caplog
):
    """The loop compiles the fingerprint's device programs from the live state's types while it
    trains (`BackgroundCompile.for_live_state`), so the job's end compiles none of them: the types
    carry each array's own sharding, whose spelling (``P()`` or ``P(None, None)``) is part of
    the program jit looks up."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from prefect_jax.training.digests import precompile_digests

    monkeypatch.setattr(trees, "_digest_on_device", device_digestible)  # (a GPU's, here a CPU)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rng = np.random.default_rng(2)
    state = {
        "w": jax.device_put(
            rng.standard_normal((48, 40), np.float32),
            NamedSharding(mesh, PartitionSpec(None, None)),
        ),
        "v": jax.device_put(
            rng.standard_normal((48, 40), np.float32), NamedSharding(mesh, PartitionSpec())
        ),
        "b": jax.device_put(rng.standard_normal(56, np.float32), jax.devices()[0]),
    }
    caplog.set_level(logging.WARNING, logger="jax._src.interpreters.pxla")

    def digest_compiles() -> int:  # (this program's alone: not another thread's compiles)
        return sum("jit(_device_lanes)" in r.getMessage() for r in caplog.records)

    with jax.log_compiles():
        types = trees.device_digest_types(state)
        assert len(types) == 3 and len(set(types)) == 3  # the two spellings are two programs
        precompile_digests(types)
        ahead = digest_compiles()
        assert ahead >= 1
        fingerprint = state_fingerprint(state)
        assert digest_compiles() == ahead  # none at the fingerprint
    assert fingerprint == state_fingerprint(jax.device_get(state))


def test_the_fingerprint_is_the_same_for_large_arrays_digested_on_the_device(monkeypatch):
    state = {"a": _arrays()[0], "b": {"c": _arrays()[3], "d": _arrays()[7]}}
    on_host = state_fingerprint(state)
    on_device = jax.tree.map(jnp.asarray, state)
    assert state_fingerprint(on_device) == on_host  # small: digested on the host
    # (a GPU's: here a CPU device stands in)
    monkeypatch.setattr(trees, "_digest_on_device", device_digestible)
    assert state_fingerprint(on_device) == on_host  # every array digested on the device


_SHARDED = """
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from prefect_jax.training import digests, trees
trees._digest_on_device = digests.device_digestible  # (a GPU's: here CPU devices stand in)
rng = np.random.default_rng(2)
state = {"w": rng.standard_normal((64, 48), np.float32),
         "e": rng.standard_normal((16, 8), np.float32).astype(jnp.bfloat16),
         "n": np.arange(40, dtype=np.int32)}
out = {"host": trees.state_fingerprint(state)}
for shape in [(8,), (4, 2)]:
    names = ("data", "model")[: len(shape)]
    mesh = jax.make_mesh(shape, names)
    specs = {"w": P(*names), "e": P(None, names[-1]), "n": P(names[0])}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in state.items()}
    out["x".join(map(str, shape))] = trees.state_fingerprint(placed)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_fingerprint_of_a_state_sharded_over_8_devices_is_the_hosts():
    prints = json_on_cpu_devices(_SHARDED, 8)
    assert prints["8"] == prints["4x2"] == prints["host"], prints
