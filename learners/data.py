"""Byte-level corpus from Python's own standard-library sources (no network), and learner shards."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 bytes
    eval: np.ndarray


def is_eval_file(relative_path: str, eval_fraction: float) -> bool:
    """Stable split by file name: the first 8 hex digits of sha1(path) as a fraction of 2³²."""
    digest = int(hashlib.sha1(relative_path.encode()).hexdigest()[:8], 16)
    return digest / 2 ** 32 < eval_fraction


def load_directory_corpus(root: str, eval_fraction: float = 0.05,
                          max_bytes: Optional[int] = None, suffix: str = ".py") -> Corpus:
    """Every ``*suffix`` file under ``root`` in sorted order, split into train/eval by file name.

    ``max_bytes`` caps each split at that many bytes (train) and a twentieth of it (eval), read in
    the same sorted order, so tests and demos load in well under a second.

    Raises:
      ValueError: if the directory holds no such files or one split comes out empty.
    """
    if not os.path.isdir(root):
        raise ValueError(f"corpus directory {root!r} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files.extend(os.path.relpath(os.path.join(dirpath, f), root)
                     for f in filenames if f.endswith(suffix))
    files.sort()
    train, evals, train_n, eval_n = [], [], 0, 0
    eval_cap = None if max_bytes is None else max(max_bytes // 20, 4096)
    for rel in files:
        to_eval = is_eval_file(rel, eval_fraction)
        if max_bytes is not None and ((to_eval and eval_n >= eval_cap)
                                      or (not to_eval and train_n >= max_bytes)):
            if train_n >= max_bytes and eval_n >= eval_cap:
                break
            continue
        try:
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read()
        except OSError:
            continue
        if to_eval:
            evals.append(blob)
            eval_n += len(blob)
        else:
            train.append(blob)
            train_n += len(blob)
    if not train or not evals:
        raise ValueError(f"corpus {root!r}: {len(train)} train and {len(evals)} eval files; "
                         "need at least one of each")
    to_array = lambda blobs, cap: np.frombuffer(b"".join(blobs), np.uint8)[:cap]  # noqa: E731
    return Corpus(train=to_array(train, max_bytes), eval=to_array(evals, eval_cap))


def load_stdlib_corpus(eval_fraction: float = 0.05, max_bytes: Optional[int] = None) -> Corpus:
    """Python's own standard-library sources: present wherever Python is."""
    return load_directory_corpus(sysconfig.get_paths()["stdlib"], eval_fraction, max_bytes)


def synthetic_corpus(num_bytes: int, seed: int = 0) -> Corpus:
    """A learnable toy corpus for tests: repeated random 'words' over a small alphabet."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(97, 105, size=rng.integers(2, 6)).astype(np.uint8) for _ in range(32)]
    pieces, n = [], 0
    while n < num_bytes:
        w = words[rng.integers(len(words))]
        pieces.extend([w, np.array([32], np.uint8)])
        n += len(w) + 1
    stream = np.concatenate(pieces)[:num_bytes]
    split = int(len(stream) * 0.9)
    return Corpus(train=stream[:split], eval=stream[split:])


class ShardSampler:
    """A learner's deterministic batch stream over its contiguous 1/num_shards slice of the bytes.

    ``batch_at(i)`` depends only on (seed, shard, i), so a restarted learner resumes its shard
    exactly where its last applied contribution ended by asking for the same index (DESIGN §5).
    """

    def __init__(self, train: np.ndarray, batch_size: int, seq_len: int, shard_index: int,
                 num_shards: int, seed: int = 0):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        size = len(train) // num_shards
        if size < seq_len + 2:
            raise ValueError(f"shard of {size} bytes is shorter than seq_len + 2 ({seq_len + 2}); "
                             "use more data or fewer learners")
        self.start = shard_index * size
        self.stop = self.start + size
        self.train = train
        self.batch_size, self.seq_len = batch_size, seq_len
        self.shard_index, self.seed = shard_index, seed

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def batch_at(self, index: int) -> np.ndarray:
        """``[B, L+1]`` int32 windows drawn inside this shard."""
        rng = np.random.default_rng((self.seed, self.shard_index, index))
        starts = rng.integers(self.start, self.stop - self.seq_len - 1, size=self.batch_size)
        return np.stack([self.train[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(eval_bytes: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[np.ndarray]:
    """Fixed, evenly spaced held-out windows: every evaluation sees the same tokens."""
    windows = batch_size * num_batches
    span = len(eval_bytes) - seq_len - 1
    if span <= 0:
        raise ValueError(f"eval split ({len(eval_bytes)} bytes) shorter than seq_len + 1")
    starts = np.linspace(0, span, windows).astype(np.int64)
    rows = np.stack([eval_bytes[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return [rows[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]
