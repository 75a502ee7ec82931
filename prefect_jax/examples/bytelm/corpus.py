"""The byte-level corpus: the Python standard library's own source files, as ArrayRecord shards.

Every machine that runs this example has the corpus: the ``.py`` files of the standard library
of the interpreter running it (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``),
so nothing is downloaded; or your own folder of text (the program params ``source`` and
``suffixes``). The files are sorted by their path under that folder and split by file (every
`EVAL_EVERY`-th file is an eval file: the 1st, the 21st, ...), so no eval text was seen in
training.

Each split's files are concatenated (a NUL byte between files) and cut into non-overlapping
windows of ``seq_len + 1`` bytes (the inputs and their next-byte targets); one window is one
ArrayRecord record. The shards are built once per (source folder, its files' names, sizes and
modification times, Python version, window, file limit) under ``<cache_root()>/bytelm/`` in a
temporary folder that is renamed into place when complete, so two processes building at once
never see (or leave) a torn corpus, and a file changed, added or removed makes a new build. Each
build records a digest of its records' bytes (`Corpus.digest`, the program's
``data_fingerprint()``): a job resumed on other text is refused, and the same text built on
another machine resumes. A split is held in memory while it is built (its files' bytes, once).

Reading is Grain's: the record indices are shuffled, repeated and batched by Grain, and each
batch of indices is read from the shards in one ArrayRecord call (per-record reads cost a
reader call each).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass

import grain
import numpy as np

EVAL_EVERY = 20
"""One file in this many (the 1st, the 21st, ... in path order) is an eval file."""

SEPARATOR = b"\x00"
SHARD_BYTES = 16 * 2**20
"""Payload bytes per shard: a few shards for the whole standard library."""

FORMAT = 2
"""Bumped when the layout of the shards or their record changes, so older builds are not read
(2: the digest of its records)."""

META = "corpus.json"
SOURCE_ENV = "PREFECT_JAX_BYTELM_SOURCE"
"""A folder of ``.py`` files to use instead of the standard library (for tests or other text)."""
SUFFIXES = (".py",)
"""The file name endings a corpus is built from, unless the program param ``suffixes`` says."""

logger = logging.getLogger("prefect_jax.examples.bytelm")


class CorpusError(ValueError):
    """The source folder has no Python files, or a split came out empty: the input is wrong (a
    ValueError: the command says it in one line, and no task retries it)."""


def source_root(source: str | None = None) -> str:
    """The folder whose ``.py`` files make the corpus: `source` (the config's), else
    ``$PREFECT_JAX_BYTELM_SOURCE``, else the standard library."""
    chosen = source or os.environ.get(SOURCE_ENV) or sysconfig.get_paths()["stdlib"]
    return os.path.abspath(os.path.expanduser(chosen))


def source_files(
    root: str, max_files: int | None = None, suffixes: tuple[str, ...] = SUFFIXES
) -> list[str]:
    """The files under `root` whose names end with one of `suffixes` (paths relative to it),
    sorted; at most `max_files`.

    Installed packages (``site-packages``, ``dist-packages``) are not the standard library and
    are left out, as are ``__pycache__`` folders.
    """
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        rel = os.path.relpath(folder, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(suffixes)]
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
    """A built corpus: its folder, each split's shard paths and window count, and `digest`: a
    hash of its window length and every record's bytes (what the model reads)."""

    path: str
    window: int
    shards: dict[str, list[str]]
    windows: dict[str, int]
    files: dict[str, list[str]]
    digest: str


def corpus_key(root: str, window: int, files: list[str], suffixes: tuple[str, ...]) -> str:
    """The cache key of a build: the folder, the files it takes with their sizes and
    modification times (a file changed under it is a new build), the Python, the window."""
    stats = [(name, *_size_and_time(root, name)) for name in files]
    blob = json.dumps([FORMAT, root, sys.version, window, EVAL_EVERY, list(suffixes), stats])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _size_and_time(root: str, name: str) -> tuple[int, int]:
    stat = os.stat(os.path.join(root, name))
    return stat.st_size, stat.st_mtime_ns


def build(
    seq_len: int,
    max_files: int | None = None,
    cache: str | None = None,
    source: str | None = None,
    suffixes: tuple[str, ...] = SUFFIXES,
) -> Corpus:
    """The corpus for sequences of `seq_len` tokens: built on first use, then read from the cache.

    Args:
        seq_len: tokens per training sequence (records hold ``seq_len + 1`` bytes).
        max_files: use only the first this many source files (path order); None: all.
        cache: the cache root (default `prefect_jax.training.storage.cache_root()`).
        source: the folder of text files (default: `source_root`'s).
        suffixes: the file name endings taken from it.

    Raises:
        CorpusError: the source folder holds no such file, or too few to split.
    """
    from prefect_jax.training.storage import cache_root

    root, window, suffixes = source_root(source), seq_len + 1, tuple(suffixes)
    named = bool(source or os.environ.get(SOURCE_ENV))
    files = source_files(root, max_files, suffixes)
    if not files:
        raise _no_files(root, suffixes, named)
    key = corpus_key(root, window, files, suffixes)
    final = os.path.join(cache or cache_root(), "bytelm", key)
    if not os.path.exists(os.path.join(final, META)):
        _build_into(final, root, window, files)
    with open(os.path.join(final, META)) as f:
        meta = json.load(f)
    shards = {
        s: [os.path.join(final, name) for name in meta["shards"][s]] for s in ("train", "eval")
    }
    return Corpus(final, window, shards, meta["windows"], meta["files"], meta["digest"])


def _no_files(root: str, suffixes: tuple[str, ...], named: bool) -> CorpusError:
    kinds = " or ".join(suffixes)
    if os.path.isfile(root):
        found = "a file, not a folder:"
    else:
        found = f"no {kinds} files under" if os.path.isdir(root) else "no folder"
    if named:
        where = (
            f"named by the program param source or ${SOURCE_ENV}: name a folder of {kinds} files "
            "there (the program param suffixes takes other endings: suffixes=.txt,.md), or "
            "neither for the standard library"
        )
    else:
        where = (
            f"the standard library of {sys.executable}: set the program param source (or "
            f"${SOURCE_ENV}) to a folder of {kinds} files"
        )
    return CorpusError(f"{found} {root!r}, the byte-level LM's corpus folder {where}")


def _build_into(final: str, root: str, window: int, files: list[str]) -> None:
    """Build the corpus of `root`'s `files` (sorted) into `final`."""
    from array_record.python.array_record_module import ArrayRecordWriter

    began = time.perf_counter()
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
        digest = hashlib.sha256(str(window).encode())
        for split, names in splits.items():
            stream = SEPARATOR.join(_read(root, name) for name in names)
            count = len(stream) // window
            if count == 0:
                raise CorpusError(
                    f"the {split} split of {root!r} ({len(names)} files, {len(stream)} bytes) "
                    f"holds no window of {window} bytes: {_split_rule(len(files))}; give more "
                    f"files (the program param source, or ${SOURCE_ENV}) or a shorter seq_len"
                )
            digest.update(f"{split}:{count}:".encode())
            digest.update(memoryview(stream)[: count * window])
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
        meta["digest"] = digest.hexdigest()[:16]
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(tmp, final)  # atomic: readers see no corpus or all of it
        except OSError:
            if not os.path.exists(os.path.join(final, META)):
                raise
            # Another process renamed its complete build into place first: use that one.
            return
        logger.info(
            "byte LM corpus built from %d files under %s in %.1fs (train: %d files, %d windows; "
            "eval: %d files, %d windows; digest %s): %s",
            len(files),
            root,
            time.perf_counter() - began,
            len(splits["train"]),
            meta["windows"]["train"],
            len(splits["eval"]),
            meta["windows"]["eval"],
            meta["digest"],
            final,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split_rule(n_files: int) -> str:
    """How `n_files` split (`split_files`), for a split that came out empty."""
    evals = -(-n_files // EVAL_EVERY)
    return (
        f"one file in {EVAL_EVERY} (the 1st, the {EVAL_EVERY + 1}st, ... in path order) is an "
        f"eval file, so its {n_files} files give {n_files - evals} train and {evals} eval files"
    )


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
