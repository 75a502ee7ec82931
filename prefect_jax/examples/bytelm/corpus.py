"""The byte-level corpus: the Python standard library's own source files, as ArrayRecord shards.

Every machine that runs this example has the corpus: the ``.py`` files of the standard library
of the interpreter running it (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``),
so nothing is downloaded. The files are sorted by their path under that folder and split by file
(every `EVAL_EVERY`-th file is an eval file), so no eval text was seen in training.

Each split's files are concatenated (a NUL byte between files) and cut into non-overlapping
windows of ``seq_len + 1`` bytes (the inputs and their next-byte targets); one window is one
ArrayRecord record. The shards are built once per (source folder, Python version, window,
file limit) under ``<cache_root()>/bytelm/`` in a temporary folder that is renamed into place
when complete, so two processes building at once never see (or leave) a torn corpus.

Reading is Grain's: the record indices are shuffled, repeated and batched by Grain, and each
batch of indices is read from the shards in one ArrayRecord call (per-record reads cost a
reader call each).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import uuid
from dataclasses import dataclass

import grain
import numpy as np

EVAL_EVERY = 20
"""One file in this many (the 1st, the 21st, ... in path order) is an eval file."""

SEPARATOR = b"\x00"
SHARD_BYTES = 16 * 2**20
"""Payload bytes per shard: a few shards for the whole standard library."""

FORMAT = 1
"""Bumped when the layout of the shards changes, so older builds are not read."""

META = "corpus.json"
SOURCE_ENV = "PREFECT_JAX_BYTELM_SOURCE"
"""A folder of ``.py`` files to use instead of the standard library (for tests or other text)."""


class CorpusError(ValueError):
    """The source folder has no Python files, or a split came out empty: the input is wrong (a
    ValueError: the command says it in one line, and no task retries it)."""


def source_root(source: str | None = None) -> str:
    """The folder whose ``.py`` files make the corpus: `source` (the config's), else
    ``$PREFECT_JAX_BYTELM_SOURCE``, else the standard library."""
    chosen = source or os.environ.get(SOURCE_ENV) or sysconfig.get_paths()["stdlib"]
    return os.path.abspath(os.path.expanduser(chosen))


def source_files(root: str, max_files: int | None = None) -> list[str]:
    """The ``.py`` files under `root` (paths relative to it), sorted; at most `max_files`.

    Installed packages (``site-packages``, ``dist-packages``) are not the standard library and
    are left out, as are ``__pycache__`` folders.
    """
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        rel = os.path.relpath(folder, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    found.sort()
    return found[:max_files] if max_files else found


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train files, eval files): file ``i`` of the sorted list is an eval file when
    ``i % EVAL_EVERY == 0``, so the split depends on the file list alone."""
    return (
        [f for i, f in enumerate(files) if i % EVAL_EVERY],
        [f for i, f in enumerate(files) if i % EVAL_EVERY == 0],
    )


@dataclass(frozen=True)
class Corpus:
    """A built corpus: its folder and each split's shard paths and window count."""

    path: str
    window: int
    shards: dict[str, list[str]]
    windows: dict[str, int]
    files: dict[str, list[str]]


def corpus_key(root: str, window: int, max_files: int | None) -> str:
    blob = json.dumps([FORMAT, root, sys.version, window, max_files, EVAL_EVERY])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build(
    seq_len: int, max_files: int | None = None, cache: str | None = None, source: str | None = None
) -> Corpus:
    """The corpus for sequences of `seq_len` tokens: built on first use, then read from the cache.

    Args:
        seq_len: tokens per training sequence (records hold ``seq_len + 1`` bytes).
        max_files: use only the first this many source files (path order); None: all.
        cache: the cache root (default `prefect_jax.training.storage.cache_root()`).
        source: the folder of ``.py`` files (default: `source_root`'s).

    Raises:
        CorpusError: the source folder holds no ``.py`` file, or too few to split.
    """
    from prefect_jax.training.storage import cache_root

    root, window = source_root(source), seq_len + 1
    final = os.path.join(cache or cache_root(), "bytelm", corpus_key(root, window, max_files))
    if not os.path.exists(os.path.join(final, META)):
        named = bool(source or os.environ.get(SOURCE_ENV))
        _build_into(final, root, window, max_files, named)
    with open(os.path.join(final, META)) as f:
        meta = json.load(f)
    shards = {
        s: [os.path.join(final, name) for name in meta["shards"][s]] for s in ("train", "eval")
    }
    return Corpus(final, window, shards, meta["windows"], meta["files"])


def _build_into(
    final: str, root: str, window: int, max_files: int | None, named: bool = True
) -> None:
    """Build the corpus of `root`'s files into `final`; `named`: the folder was given (the
    program param ``source`` or the environment), not the standard library's default."""
    from array_record.python.array_record_module import ArrayRecordWriter

    files = source_files(root, max_files)
    if not files:
        found = "no .py files under" if os.path.isdir(root) else "no folder"
        if named:
            where = (
                f"named by the program param source or ${SOURCE_ENV}: name a folder of .py "
                "files there, or neither for the standard library"
            )
        else:
            where = (
                f"the standard library of {sys.executable}: set the program param source (or "
                f"${SOURCE_ENV}) to a folder of .py files"
            )
        raise CorpusError(f"{found} {root!r}, the byte-level LM's corpus folder {where}")
    splits = dict(zip(("train", "eval"), split_files(files), strict=True))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        meta = {
            "format": FORMAT,
            "root": root,
            "window": window,
            "python": sys.version,
            "files": splits,
            "shards": {},
            "windows": {},
        }
        for split, names in splits.items():
            stream = SEPARATOR.join(_read(root, name) for name in names)
            count = len(stream) // window
            if count == 0:
                raise CorpusError(
                    f"the {split} split of {root!r} ({len(names)} files, {len(stream)} bytes) "
                    f"holds no window of {window} bytes: give more files (the program param "
                    f"source, or ${SOURCE_ENV}) or a shorter seq_len"
                )
            per_shard = max(1, SHARD_BYTES // window)
            n_shards = -(-count // per_shard)
            meta["shards"][split], meta["windows"][split] = [], count
            for k in range(n_shards):
                name = f"{split}-{k:05d}-of-{n_shards:05d}.array_record"
                # group_size:1 is what random access (Grain's data source) asks for.
                writer = ArrayRecordWriter(os.path.join(tmp, name), "group_size:1,uncompressed")
                for i in range(k * per_shard, min(count, (k + 1) * per_shard)):
                    writer.write(stream[i * window : (i + 1) * window])
                writer.close()
                meta["shards"][split].append(name)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(tmp, final)  # atomic: readers see no corpus or all of it
        except OSError:
            if not os.path.exists(os.path.join(final, META)):
                raise
            # Another process renamed its complete build into place first: use that one.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read(root: str, name: str) -> bytes:
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


class ReadWindows:
    """Grain map: a batch of record indices -> ``{"tokens": uint8 (batch, window)}``, read from
    the shards in one call (the ArrayRecord source opens its readers on first use)."""

    def __init__(self, paths: list[str], window: int):
        self.paths, self.window, self._source = list(paths), window, None

    def __call__(self, indices) -> dict[str, np.ndarray]:
        if self._source is None:
            self._source = grain.sources.ArrayRecordDataSource(self.paths)
        records = self._source.__getitems__([int(i) for i in np.asarray(indices).reshape(-1)])
        tokens = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), self.window)
        return {"tokens": tokens}


def train_dataset(corpus: Corpus, batch_size: int, seed: int) -> grain.MapDataset:
    """Endless shuffled batches of training windows (reshuffled each epoch, remainder dropped)."""
    indices = grain.MapDataset.range(corpus.windows["train"]).shuffle(seed=seed % 2**32).repeat()
    batches = indices.batch(batch_size, drop_remainder=True)
    return batches.map(ReadWindows(corpus.shards["train"], corpus.window))


class Spread:
    """Grain map: the i-th of `count` window indices spread evenly over `total` windows."""

    def __init__(self, total: int, count: int):
        self.total, self.count = total, count

    def __call__(self, i) -> int:
        return int(i) * self.total // self.count


def eval_dataset(corpus: Corpus, batch_size: int, max_windows: int | None) -> grain.MapDataset:
    """`max_windows` eval windows spread evenly over the eval split, the same ones every time, in
    batches (the last may be smaller). The first ones in order were the start of one file or two
    (the split is the files' bytes one after another): `tiny`'s 64 windows of 33 bytes were 2 KB
    of ``__future__.py``, an eval loss and a best export judged on that."""
    total = corpus.windows["eval"]
    count = min(total, max_windows or total)
    indices = grain.MapDataset.range(count).map(Spread(total, count))
    return indices.batch(batch_size).map(ReadWindows(corpus.shards["eval"], corpus.window))
