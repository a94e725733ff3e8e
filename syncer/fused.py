"""The syncer's hot path in place: a push's outer gradient with its norms, folded into its
round's running sums (``GradSum``), and a fragment's merge with its outer step from those sums,
each as few passes over memory as the math allows, into reused buffers.

Plain numpy expressions walk a fragment once per operation and allocate a fresh array for each
(θ = base + δ, g = Θ − θ, φ(g), the weighted sums, the optimizer's moments, Θ's update); a jitted
XLA program on the syncer's single CPU thread measured slower still (26 ns per parameter for
``Θ − (base + δ)``, against 2 ns for a copy). Here ``outer_gradient`` writes g into a buffer of
the pool (two subtractions and a dot), ``GradSum.fold`` adds it to the round's sums as the push
is accepted (one BLAS axpy per sum), and ``step_sums`` walks the fragment in blocks of ``BLOCK``
values: each block of the merged gradient is made from the sums while it sits in cache, and SGD
or Nesterov is applied to it there, writing the new momentum and a new Θ once (``step_sums``
counts the passes, whatever the number of learners). Other outer optimizers (adam) take optax's
compiled step. The math is ``merge.py``'s and ``outer.py``'s
(docs/architecture.md#token-weighted-merge-and-rda): ``RDA = (Σ w‖g‖/Σ w)·φ(Σ w φ(g)/Σ w)``,
falling back to the weighted mean when the directions cancel, the embeddings always the mean;
``optax.sgd``: ``m ← g + μ·m``, ``Θ ← Θ − lr·(g + μ·m)`` (Nesterov) or ``Θ − lr·m``. The order of
float32 operations differs from ``merge.py`` (the sums are normalised by Σ w once, at the merge;
the RDA scale applied once with the participation share), so results agree to float32 rounding.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Any, Optional, Sequence

import numpy as np
from scipy.linalg import blas

from . import outer as outer_lib

RDA_EPS = 1e-12   # as merge.radial_directional_average


class BufferPool:
    """Float32 arrays by shape, handed back after a merge so the next pushes reuse them (fresh
    arrays cost a page fault per 4 KiB on first touch: as much again as writing them)."""

    def __init__(self, per_shape: int = 16):
        self.free: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.per_shape = per_shape

    def take(self, shape: tuple) -> np.ndarray:
        free = self.free.get(tuple(shape))
        return free.pop() if free else np.empty(shape, np.float32)

    def give(self, array: np.ndarray) -> None:
        free = self.free[array.shape]
        if len(free) < self.per_shape:
            free.append(array)


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1)


def tensor_norm(x: np.ndarray) -> float:
    flat = _flat(x)
    return math.sqrt(max(float(blas.sdot(flat, flat)), 0.0)) if flat.size else 0.0


def _axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a·x`` in place (y contiguous float32)."""
    if y.size:
        flat = _flat(y)
        out = blas.saxpy(_flat(x), flat, a=a)
        if out is not flat and not np.shares_memory(out, flat):   # BLAS copied: keep the result
            np.copyto(flat, out)


def outer_gradient(params: dict, base: dict, drift: dict,
                   pool: Optional[BufferPool] = None) -> tuple[dict, dict]:
    """``g = Θ − (base + δ)`` per tensor and ``‖g‖`` (float32 g, float norms).

    ``base + δ`` is the learner's fragment θ_m as the syncer reconstructs it. g is computed as
    ``(Θ − base) − δ``, so it may differ from ``Θ − (base + δ)`` in the last bit.
    """
    grads, norms = {}, {}
    for path, value in params.items():
        g = pool.take(value.shape) if pool is not None else np.empty(value.shape, np.float32)
        np.subtract(value, base[path], out=g)
        np.subtract(g, np.asarray(drift[path], np.float32), out=g)
        grads[path] = g
        norms[path] = tensor_norm(g)
    return grads, norms


BLOCK = 1 << 18   # values per block (1 MiB of float32): a block of each operand stays in cache
                  # between the ufuncs of a pass (BENCHMARKS.md: 256K beat 16K and 64K here)


def _blocks(size: int):
    return ((lo, min(lo + BLOCK, size)) for lo in range(0, size, BLOCK))


def _direction(grads: Sequence[np.ndarray], coefs: Sequence[float], out: np.ndarray,
               step=None) -> float:
    """``out = Σ c_m g_m`` block by block, in one pass over the g's (each block summed in cache:
    a scaled copy, then one BLAS axpy per learner); returns ``‖out‖²``. With ``step`` (a callable
    ``(lo, hi, d) -> None``) each finished block is handed on while it is still in cache; ``out``
    is then a block-sized scratch array."""
    flats = [_flat(g) for g in grads]
    size = flats[0].size if flats else 0
    norm_sq = 0.0
    for lo, hi in _blocks(size):
        d = out[:hi - lo] if step is not None else _flat(out)[lo:hi]
        np.multiply(flats[0][lo:hi], np.float32(coefs[0]), out=d)
        for g, c in zip(flats[1:], coefs[1:]):
            _axpy(c, g[lo:hi], d)
        norm_sq += float(blas.sdot(d, d))
        if step is not None:
            step(lo, hi, d)
    return norm_sq


def _sgd_kind(optimizer) -> Optional[tuple[float, float, bool]]:
    spec = getattr(optimizer, "spec", None)
    if spec is None or spec[0] not in ("nesterov", "sgd"):
        return None
    kind, lr, momentum = spec
    return float(lr), float(momentum or 0.0), kind == "nesterov"


def _trace(state: Any) -> Optional[dict]:
    """The momentum ``{path: array}`` inside an optax sgd state (None without momentum)."""
    for part in state:
        trace = getattr(part, "trace", None)
        if trace is not None:
            return trace
    return None


def _stepper(theta: np.ndarray, new: np.ndarray, trace: Optional[np.ndarray],
             new_trace: Optional[np.ndarray], lr: float, momentum: float, nesterov: bool,
             finite: list):
    """The SGD / Nesterov step of one block, in cache: ``step(lo, hi, d, s)`` with ``G = s·d``
    the block of the merged outer gradient. ``m' = G + μ·m``; ``Θ' = Θ − lr·(G + μ·m')``
    (Nesterov, as ``Θ − lr·G − lr·μ·m'``), ``Θ − lr·m'`` (momentum) or ``Θ − lr·G``;
    ``finite[0]`` turns False on a non-finite Θ'. Each block of Θ, m is read once and of Θ', m'
    written once."""

    def step(lo: int, hi: int, d: np.ndarray, s: float) -> None:
        out = new[lo:hi]
        if new_trace is None:
            np.multiply(d, np.float32(-lr * s), out=out)
        else:
            m = new_trace[lo:hi]
            np.multiply(trace[lo:hi], np.float32(momentum), out=m)
            _axpy(s, d, m)
            if nesterov:
                np.multiply(d, np.float32(-lr * s), out=out)
                _axpy(-lr * momentum, m, out)
            else:
                np.multiply(m, np.float32(-lr), out=out)
        _axpy(1.0, theta[lo:hi], out)
        if finite[0] and not math.isfinite(float(blas.sdot(out, out))):
            finite[0] = bool(np.all(np.isfinite(out)))

    return step


# -- running sums: a round's pushes folded as they arrive ----------------------------------------
class GradSum:
    """The pushes of a round folded into running sums as they arrive, so a round holds one or two
    fragment-sized arrays however many learners are in it (not one outer gradient each).

    Per tensor: ``mean = Σ w g`` and, for RDA tensors, ``direction = Σ (w/‖g‖) g`` over the g ≠ 0
    with ``length = Σ w‖g‖``; ``weight = Σ w``. A merge is then ``mean/Σw`` (the weighted mean)
    or ``(length/Σw)·φ(direction)`` (RDA), falling back to the mean when the directions cancel:
    ``merge.py``'s math with the normalisation by Σ w taken once at the end (float32 rounding
    apart, the same numbers). While every weight folded is 0 (pushes of zero steps) the sums are
    unweighted, as ``SyncerCore.merge`` takes all weights as 1 then; the first positive weight
    starts them over with its push alone (a zero weight adds nothing after it).
    """

    def __init__(self, rda_paths: frozenset):
        self.rda_paths = rda_paths
        self.mean: dict = {}
        self.direction: dict = {}
        self.length: dict = {}
        self.weight = 0.0
        self.positive = False   # a positive weight is in (else the sums are of weight 1 each)
        self.count = 0
        self.in_sums = 0        # pushes inside the sums (a zero weight after a positive is not)
        self.directed: dict = {}   # path -> pushes inside ``direction[path]`` (‖g‖ > 0)

    def release(self, pool: Optional[BufferPool]) -> None:
        """Hands the arrays to the pool; the sum is empty afterwards."""
        if pool is not None:
            for v in itertools.chain(self.mean.values(), self.direction.values()):
                pool.give(v)
        self.mean, self.direction, self.length, self.directed = {}, {}, {}, {}
        self.weight, self.positive, self.count, self.in_sums = 0.0, False, 0, 0

    def fold(self, grads: dict, norms: dict, weight: float, unit_weight: float = 1.0,
             pool: Optional[BufferPool] = None) -> None:
        """Adds one outer gradient ``{path: g}`` (norms ``{path: ‖g‖}``) with its merge weight;
        ``unit_weight``: what it weighs when every weight of the round is 0 (a group: its
        members)."""
        count = self.count + 1
        if weight > 0:
            if not self.positive:
                self.release(pool)   # the unweighted sums of zero weights are void now
                self.positive = True
        elif self.positive:
            self.count = count
            return                   # weighs nothing next to the positive weights in
        else:
            weight = unit_weight
        self.count = count
        self.in_sums += 1
        w = float(weight)
        take = pool.take if pool is not None else (lambda shape: np.empty(shape, np.float32))
        for path, g in grads.items():
            n = norms[path]
            targets = [(self.mean, w)]
            if path in self.rda_paths:
                self.length[path] = self.length.get(path, 0.0) + w * n
                if n > 0:
                    targets.append((self.direction, w / n))
                    self.directed[path] = self.directed.get(path, 0) + 1
            for target, c in targets:
                if path not in target:
                    target[path] = take(g.shape)
                    np.multiply(g, np.float32(c), out=target[path])
                else:
                    _axpy(c, g, target[path])
        self.weight += w

    def unfold(self, grads: dict, norms: dict, weight: float, unit_weight: float = 1.0,
               pool: Optional[BufferPool] = None) -> bool:
        """Takes out one outer gradient ``fold`` added with these arguments (its push left the
        round): ``−c·g`` for each ``+c·g`` it added, to float32 rounding of the sums' terms.
        Returns False when subtracting cannot give the sum of the pushes that stay, or not
        precisely, which must then be folded again (the sums are emptied): it held the only
        positive weights while pushes of weight 0 stay (those were left out of the sums,
        ``fold``), or it weighs more than all that stay together (its float32 terms would
        dominate theirs, and the difference would keep its rounding as theirs: cancellation).
        A tensor none of whose remaining pushes points anywhere keeps no direction and a
        length of exactly 0."""
        if self.count <= 0:
            raise ValueError("unfold: the sum holds no push")
        if weight > 0 and not self.positive:
            raise ValueError("unfold: a positive weight that the sum does not hold")
        self.count -= 1
        if weight <= 0 and self.positive:
            return True             # it added nothing
        w = float(weight) if weight > 0 else float(unit_weight)
        self.in_sums -= 1
        if self.in_sums == 0 or w > self.weight - w:
            # Nothing left in the sums: empty them, not a residue; or what stays weighs less
            # than what leaves: folded again from the pushes that stay (the caller's part).
            count = self.count
            self.release(pool)
            self.count = count      # (pushes of weight 0 left out of the sums may stay)
            return count == 0
        for path, g in grads.items():
            n = norms[path]
            _axpy(-w, g, self.mean[path])
            if path in self.rda_paths:
                self.length[path] = self.length.get(path, 0.0) - w * n
                if n > 0:
                    self.directed[path] -= 1
                    if self.directed[path] == 0:    # the rest point nowhere: no residue kept
                        del self.directed[path]
                        self.length[path] = 0.0     # (their norms are all 0)
                        v = self.direction.pop(path)
                        if pool is not None:
                            pool.give(v)
                    else:
                        _axpy(-w / n, g, self.direction[path])
        self.weight -= w
        return True

    def absorb(self, other: "GradSum", pool: Optional[BufferPool] = None) -> None:
        """``self += other`` (the pushes of a partial merge join their round's sum); ``other``
        is emptied."""
        if other.positive and not self.positive:
            self.release(pool)
            self.positive = True
        if other.positive == self.positive:
            for mine, theirs in ((self.mean, other.mean), (self.direction, other.direction)):
                for path, v in theirs.items():
                    if path in mine:
                        _axpy(1.0, v, mine[path])
                        if pool is not None:
                            pool.give(v)
                    else:
                        mine[path] = v
                theirs.clear()
            for path, x in other.length.items():
                self.length[path] = self.length.get(path, 0.0) + x
            for path, x in other.directed.items():
                self.directed[path] = self.directed.get(path, 0) + x
            self.weight += other.weight
            self.in_sums += other.in_sums
        self.count += other.count
        other.release(pool)


def counted(sums: Sequence[GradSum]) -> list[GradSum]:
    """The sums a merge takes: those holding positive weights, or all when none does."""
    positive = [s for s in sums if s.positive and s.count]
    return positive or [s for s in sums if s.count]


def _sum_direction(sums, path, use_rda, out, step=None) -> tuple[float, float, bool]:
    """One tensor's merged direction over the running sums: writes it into ``out`` (or hands
    each block to ``step``) and returns ``(scale, norm, rda)``, the merged outer gradient being
    ``scale · out``: RDA (``Σ direction / Σ w``, scaled to the mean norm ``Σ length / Σ w``)
    when the directions do not cancel, else the weighted mean ``Σ mean / Σ w`` (scale 1), as
    ``merge.py``."""
    total = sum(s.weight for s in sums)
    if use_rda:
        parts = [s.direction[path] for s in sums if path in s.direction]
        if parts:
            mean_norm = sum(s.length.get(path, 0.0) for s in sums) / total
            d_norm = math.sqrt(max(_direction(parts, [1.0 / total] * len(parts), out), 0.0))
            if d_norm >= RDA_EPS:
                if step is not None:
                    flat = _flat(out)
                    for lo, hi in _blocks(flat.size):
                        step(lo, hi, flat[lo:hi], mean_norm / d_norm)
                return mean_norm / d_norm, mean_norm, True
    parts = [s.mean[path] for s in sums]
    coefs = [1.0 / total] * len(parts)
    if step is not None and not use_rda:   # one pass: each block stepped while in cache
        block = _flat(out)[:min(BLOCK, out.size)]
        return 1.0, math.sqrt(max(_direction(parts, coefs, block,
                                             step=lambda lo, hi, d: step(lo, hi, d, 1.0)),
                                  0.0)), False
    norm = math.sqrt(max(_direction(parts, coefs, out), 0.0))
    if step is not None:
        flat = _flat(out)
        for lo, hi in _blocks(flat.size):
            step(lo, hi, flat[lo:hi], 1.0)
    return 1.0, norm, False


def step_sums(optimizer, sums: Sequence[GradSum], share: float, params: dict, state: Any,
              pool: Optional[BufferPool] = None, recycle_state: bool = True):
    """Merges a fragment's pushes from their running sums (``GradSum``; several: a round's
    and a joining merge's, taken together without changing either) and applies the outer
    optimizer. Passes over memory per tensor (one = its N float32 values read or written) with
    SGD / Nesterov (``_stepper``), in blocks of ``BLOCK``: the weighted mean 1 + 4 (read the
    sum, Θ and m; write m' and Θ': the merged block never leaves the cache), RDA 2 + 5 (the
    direction and its norm, since ‖φ(d)‖ must be known before the first value of the step; then
    the step), two fewer without momentum, whatever the number of learners. Other optimizers
    (adam) get the merged gradient as arrays and optax's compiled step.

    ``optimizer``: the outer optax transform (``outer.build``'s carry their kind: sgd and
    Nesterov run in place). ``share``: the participation scale n/M (1 without it). ``params``
    (Θ of the fragment) and ``state`` are not modified: earlier versions stay in the history.

    ``recycle_state``: the old momentum buffers may go back to the pool (False: the state is
    kept, as ``round_step: per_round`` keeps its round's start).

    Returns ``(new Θ, new state, every value finite, ‖merged outer gradient‖)``.
    """
    sums = counted(sums)
    if not sums:
        raise ValueError("no pushes to merge")
    with np.errstate(over="ignore", invalid="ignore"):
        return _step_sums(optimizer, sums, share, params, state, pool, recycle_state)


def _step_sums(optimizer, sums, share, params, state, pool, recycle_state):
    take = pool.take if pool is not None else (lambda shape: np.empty(shape, np.float32))
    give = pool.give if pool is not None else (lambda array: None)
    rda_paths = sums[0].rda_paths
    sgd = _sgd_kind(optimizer)
    trace = _trace(state) if sgd is not None else None
    merged, new_params, norm_sq, finite = {}, {}, 0.0, [True]
    new_trace = {} if trace is not None else None
    for path, value in params.items():
        use_rda = path in rda_paths
        out = take(value.shape)
        if sgd is None:
            scale, norm, _ = _sum_direction(sums, path, use_rda, out)
            if scale * share != 1.0:
                out *= np.float32(scale * share)
            norm_sq += (norm * share) ** 2
            merged[path] = out
            continue
        lr, momentum, nesterov = sgd
        new = np.empty(value.shape, np.float32)
        m_new = take(value.shape) if trace is not None else None
        stepper = _stepper(_flat(np.asarray(value, np.float32)), _flat(new),
                           None if trace is None else _flat(np.asarray(trace[path], np.float32)),
                           None if m_new is None else _flat(m_new), lr, momentum, nesterov,
                           finite)
        _, norm, _ = _sum_direction(sums, path, use_rda, out,
                                    step=lambda lo, hi, d, s, st=stepper: st(lo, hi, d,
                                                                             s * share))
        norm_sq += (norm * share) ** 2
        give(out)
        new_params[path] = new
        if new_trace is not None:
            new_trace[path] = m_new
    grad_norm = math.sqrt(norm_sq)
    if sgd is None:
        new_params, new_state = outer_lib.outer_step(optimizer, merged, state, params)
        finite = [all(np.isfinite(tensor_norm(v)) or bool(np.all(np.isfinite(v)))
                      for v in new_params.values())]
        for v in merged.values():
            give(v)
        return new_params, new_state, finite[0], grad_norm
    new_state = state if trace is None else tuple(
        part._replace(trace=new_trace) if getattr(part, "trace", None) is not None else part
        for part in state)
    if trace is not None and recycle_state and finite[0]:
        for v in trace.values():   # the old momentum is no one's
            if isinstance(v, np.ndarray) and v.flags.writeable:
                give(v)
    return new_params, new_state, finite[0], grad_norm
