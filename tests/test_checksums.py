"""A step's checksums are each file's CRC32, computed in blocks on several threads and combined:
equal to zlib's CRC32 of the whole file at every size around a block's edges."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from prefect_jax.training import checksums


def test_crc32_combine_is_zlibs():
    data = os.urandom(10_000)
    for cut in (0, 1, 7, 4096, 9_999, 10_000):
        a, b = data[:cut], data[cut:]
        assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


@pytest.mark.parametrize("threads", [1, 3])
def test_file_crc32s_in_blocks_are_each_files_crc32(tmp_path, monkeypatch, threads):
    # Blocks and reads a few hundred bytes long, so that sizes around their edges stay small.
    monkeypatch.setattr(checksums, "_BLOCK", 1000)
    monkeypatch.setattr(checksums, "_READ", 300)
    monkeypatch.setattr(checksums, "_MAX_THREADS", threads)
    sizes = [0, 1, 299, 300, 999, 1000, 1001, 2000, 2999, 3001, 10_007]
    paths = []
    for size in sizes:
        path = tmp_path / f"f{size}"
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    assert checksums.file_crc32s(paths) == [
        (size, zlib.crc32(Path(p).read_bytes())) for size, p in zip(sizes, paths, strict=True)
    ]


def test_a_file_that_changes_size_while_it_is_read_is_an_error_not_a_wrong_checksum(
    tmp_path, monkeypatch
):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2500))
    monkeypatch.setattr(checksums, "_BLOCK", 1000)
    real = os.path.getsize
    monkeypatch.setattr(checksums.os.path, "getsize", lambda p: real(p) + 10)  # (it shrank)
    with pytest.raises(OSError, match="changed while it was checksummed"):
        checksums.file_crc32s([str(path)])
    with pytest.raises(ValueError, match="length2=-1"):
        checksums.crc32_combine(1, 2, -1)


def test_a_manifest_written_in_blocks_finds_a_flipped_bit_in_any_block(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "_BLOCK", 1000)
    step = tmp_path / "7"
    step.mkdir()
    (step / "data").write_bytes(os.urandom(4500))
    checksums.write_manifest(str(step))
    assert checksums.verify_manifest(str(step)) is True
    raw = bytearray((step / "data").read_bytes())
    raw[3210] ^= 0x10  # in the fourth block
    (step / "data").write_bytes(bytes(raw))
    with pytest.raises(checksums.CorruptCheckpointError, match="crc32 differs"):
        checksums.verify_manifest(str(step))
