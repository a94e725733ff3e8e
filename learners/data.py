"""Byte-level corpus from Python's own standard-library sources (no network), and learner shards.

The vocabulary is the 256 byte values. Files are read in sorted relative-path order and assigned to
train or eval by a hash of that path, so every process (and every restart) sees the same corpus
without coordination (docs/architecture.md#wan-emulation-and-data).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Optional

import numpy as np

DEFAULT_EVAL_FRACTION = 0.05
# Directories under the stdlib that aren't the stdlib's own sources.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# With ``max_bytes``, eval is capped at max_bytes // EVAL_CAP_DIVISOR, at least MIN_EVAL_BYTES.
EVAL_CAP_DIVISOR = 20
MIN_EVAL_BYTES = 4096


@dataclass(frozen=True)
class Corpus:
    """Train and held-out bytes.

    Attributes:
      train: uint8 ``[N_train]``, the concatenated train files.
      eval: uint8 ``[N_eval]``, the concatenated eval files (disjoint files from train).
    """

    train: np.ndarray
    eval: np.ndarray


def is_eval_file(relative_path: str, eval_fraction: float) -> bool:
    """Stable split by file name: the first 8 hex digits of sha1(path), as a fraction of 2³², below
    ``eval_fraction``.

    Args:
      relative_path: the file's path relative to the corpus root, with ``/`` separators.
      eval_fraction: share of files (not bytes) that go to eval, in (0, 1).
    """
    digest = int(hashlib.sha1(relative_path.encode("utf-8")).hexdigest()[:8], 16)
    return digest / 2 ** 32 < eval_fraction


def list_files(root: str, suffix: str = ".py") -> list[str]:
    """Every ``*suffix`` file under ``root`` as a sorted ``/``-separated relative path.

    ``/`` separators keep the hash split identical on every OS.
    """
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(suffix):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                files.append(rel.replace(os.sep, "/"))
    return sorted(files)


def load_directory_corpus(root: str, eval_fraction: float = DEFAULT_EVAL_FRACTION,
                          max_bytes: Optional[int] = None, max_files: Optional[int] = None,
                          suffix: str = ".py") -> Corpus:
    """Every ``*suffix`` file under ``root`` in sorted order, split into train/eval by file name.

    Args:
      root: corpus directory.
      eval_fraction: share of files that go to eval, in (0, 1).
      max_bytes: caps train at this many bytes and eval at ``max(max_bytes // 20, 4096)``, both
        filled in sorted file order, so tests and demos load in well under a second. None: no cap.
      max_files: reads only the first ``max_files`` files of the sorted list. None: all.
      suffix: file name ending to include.

    Returns:
      The corpus; deterministic for the same directory contents and arguments.

    Raises:
      ValueError: on bad arguments, a missing directory, or an empty split.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None, got {max_files}")
    if not os.path.isdir(root):
        raise ValueError(f"corpus directory {root!r} does not exist")
    files = list_files(root, suffix)[:max_files]
    train_cap = max_bytes
    eval_cap = None if max_bytes is None else max(max_bytes // EVAL_CAP_DIVISOR, MIN_EVAL_BYTES)
    blobs: dict[bool, list[bytes]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    caps = {False: train_cap, True: eval_cap}
    full = lambda split: caps[split] is not None and counts[split] >= caps[split]  # noqa: E731
    for rel in files:
        if full(False) and full(True):
            break
        to_eval = is_eval_file(rel, eval_fraction)
        if full(to_eval):
            continue  # keep walking: the other split may still need files
        try:
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read()
        except OSError:
            continue  # an unreadable file is skipped the same way on every read
        blobs[to_eval].append(blob)
        counts[to_eval] += len(blob)
    if not blobs[False] or not blobs[True]:
        raise ValueError(f"corpus {root!r}: {len(blobs[False])} train and {len(blobs[True])} eval "
                         f"files of {len(files)}; need at least one of each (raise max_files or "
                         "eval_fraction)")

    def to_array(parts: list[bytes], cap: Optional[int]) -> np.ndarray:
        return np.frombuffer(b"".join(parts), np.uint8)[:cap].copy()

    return Corpus(train=to_array(blobs[False], train_cap), eval=to_array(blobs[True], eval_cap))


def stdlib_root() -> str:
    """The directory of this Python's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def load_stdlib_corpus(eval_fraction: float = DEFAULT_EVAL_FRACTION,
                       max_bytes: Optional[int] = None,
                       max_files: Optional[int] = None) -> Corpus:
    """Python's own standard-library ``.py`` sources: present wherever Python is, no network.

    Deterministic for a given Python installation; takes no seed. See
    :func:`load_directory_corpus` for the arguments.
    """
    return load_directory_corpus(stdlib_root(), eval_fraction, max_bytes, max_files)


def synthetic_corpus(num_bytes: int, seed: int = 0) -> Corpus:
    """A learnable toy corpus for tests: random 'words' over 8 letters, space-separated.

    Args:
      num_bytes: total bytes; the first 90 % are train, the rest eval.
      seed: numpy seed for the vocabulary and the word sequence.
    """
    if num_bytes < 20:
        raise ValueError(f"num_bytes must be >= 20, got {num_bytes}")
    rng = np.random.default_rng(seed)
    words = [rng.integers(ord("a"), ord("i"), size=int(rng.integers(2, 6))).astype(np.uint8)
             for _ in range(32)]
    pieces, n = [], 0
    space = np.array([ord(" ")], np.uint8)
    while n < num_bytes:
        word = words[int(rng.integers(len(words)))]
        pieces.extend([word, space])
        n += len(word) + 1
    stream = np.concatenate(pieces)[:num_bytes]
    split = int(len(stream) * 0.9)
    return Corpus(train=stream[:split], eval=stream[split:])


class ShardSampler:
    """A learner's deterministic batch stream over its contiguous 1/num_shards slice of the bytes.

    ``batch_at(i)`` depends only on (seed, shard_index, i) for the same bytes, so a restarted
    learner resumes its shard exactly where its last applied contribution ended by asking for the
    same index (docs/architecture.md#failures-and-reintegration). Windows are drawn uniformly inside the shard and never cross its end.

    Attributes:
      start, stop: the shard's byte range ``[start, stop)`` in ``train_bytes``.
    """

    def __init__(self, train_bytes: np.ndarray, batch_size: int, seq_len: int, shard_index: int,
                 num_shards: int, seed: int = 0):
        """
        Args:
          train_bytes: uint8 ``[N]``, the whole train split (shared by every learner).
          batch_size: windows per batch (B).
          seq_len: model input length (L); each window holds L + 1 bytes.
          shard_index: this learner's shard, in ``[0, num_shards)``.
          num_shards: how many contiguous, equal, disjoint slices the bytes are cut into.
          seed: non-negative int; the same seed gives the same stream.

        Raises:
          ValueError: on bad sizes or a shard shorter than one window.
        """
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                            ("num_shards", num_shards)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        size = len(train_bytes) // num_shards
        if size < seq_len + 1:
            raise ValueError(f"shard of {size} bytes is shorter than seq_len + 1 ({seq_len + 1}); "
                             "use more data or fewer learners")
        self.train_bytes = train_bytes
        self.batch_size, self.seq_len = batch_size, seq_len
        self.shard_index, self.num_shards, self.seed = shard_index, num_shards, seed
        self.start = shard_index * size
        self.stop = self.start + size

    @property
    def tokens_per_batch(self) -> int:
        """Tokens trained on per batch, B·L (the ``c_tokens`` increment of docs/architecture.md#the-algorithm)."""
        return self.batch_size * self.seq_len

    def window_starts(self, index: int) -> np.ndarray:
        """Start offsets ``[B]`` of batch ``index``'s windows, each in ``[start, stop − L − 1]``."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        rng = np.random.default_rng((self.seed, self.shard_index, index))
        # high is exclusive: the last window [stop − L − 1, stop) ends exactly at the shard's end.
        return rng.integers(self.start, self.stop - self.seq_len, size=self.batch_size)

    def batch_at(self, index: int) -> np.ndarray:
        """Batch ``index`` as int32 ``[B, L+1]`` windows inside this shard."""
        offsets_BxLp1 = self.window_starts(index)[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.train_bytes[offsets_BxLp1].astype(np.int32)


def eval_batches(eval_bytes: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[np.ndarray]:
    """Fixed, evenly spaced held-out windows: every evaluation sees the same tokens.

    Args:
      eval_bytes: uint8 ``[N]``, the eval split.
      batch_size: windows per batch (B).
      seq_len: model input length (L).
      num_batches: how many batches.

    Returns:
      ``num_batches`` int32 arrays ``[B, L+1]``.

    Raises:
      ValueError: on bad sizes or an eval split shorter than one window.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                        ("num_batches", num_batches)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    last_start = len(eval_bytes) - (seq_len + 1)
    if last_start < 0:
        raise ValueError(f"eval split ({len(eval_bytes)} bytes) shorter than seq_len + 1 "
                         f"({seq_len + 1})")
    starts = np.linspace(0, last_start, batch_size * num_batches).astype(np.int64)
    rows = eval_bytes[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return [rows[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]
