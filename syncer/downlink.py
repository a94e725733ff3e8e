"""The encoded downlink: what the syncer sends back after a merge, and how a learner applies it.

Without it the syncer answers every merged push with the whole fragment in fp32, which is most of
the job's wire bytes once pushes are compressed. With a downlink codec the syncer keeps, per
learner and fragment, a *shadow* ``S``: exactly the fragment that learner holds. After a merge it
sends the codec's encoding of ``Θ_new − S`` and records ``S' = S + decode(code)``; the learner
computes the same ``S'`` from its own copy with the same host function (``apply_codes``), so the
two agree bit for bit and the drift it pushes next, ``θ − S'``, reconstructs exactly on the syncer.

Error feedback comes with the shadow: what a code leaves out, ``Θ_new − S'``, is part of the next
difference the syncer encodes, so the learner's copy never drifts further than one code's error
from Θ (``error_feedback=False`` encodes ``Θ_new − Θ(v_base)``, the merges since the learner's
version, instead; the shadow still says exactly what it holds, but the errors add up).

Ids keep the two ends honest: every shadow has an id that the learner stores with its base and
sends with each push (``Push.base_shadow``); 0 means "the exact global fragment of
``base_version``", which is what a learner holds after it joins, re-bases or receives a full
fragment. An update applies only to the base it was made from (``DiffUpdate.from_id``); anything
that does not match is refused on the syncer as an unknown base, and the learner re-bases on the
full fragment that rides along with the refusal.

A learner gets the full fragment (``FullUpdate``) when the downlink has no codec (fp32, the
default), and when it is more than ``full_after_versions`` versions behind the merge.

>>> from islands.syncer import codec as codec_lib
>>> settings = DownlinkSettings(codec_lib.make_codec("int2", block_size=4))
>>> base = {"w": np.array([1.0, 1.0, 1.0, 1.0], np.float32)}
>>> new = {"w": np.array([1.75, 0.75, 1.0, 1.25], np.float32)}   # Θ − S = [.75, −.25, 0, .25]
>>> update, shadow = make_update(settings, base, 0, 3, new, 4, 7)
>>> update.from_id, update.to_id, update.version, update_bytes(update)   # 1 byte + 1 scale
(0, 7, 4, 5)
>>> shadow.params["w"], resolve(update, base, 0)[0]["w"]   # both ends: S + decode
(array([1.75, 0.75, 1.25, 1.25], dtype=float32), array([1.75, 0.75, 1.25, 1.25], dtype=float32))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional

from islands import defaults

import numpy as np

# No JAX at import (the Ray learner sets its XLA flags before JAX loads): ``codec`` is imported
# where a code is made or read.
Fragment = dict

EXACT = 0  # the base id of a learner holding the exact global fragment of its base version


@dataclass(frozen=True)
class DownlinkSettings:
    """How the syncer answers merged pushes (JobConfig ``downlink_compression`` and
    ``syncer.downlink_full_after_versions``).

    Attributes:
      codec: the downlink codec; None sends the whole fragment in fp32 (exact, no shadows).
      error_feedback: encode the difference to the learner's shadow (True) rather than to the
        global fragment of its base version.
      full_after_versions: a learner whose base is more than this many versions behind the merge
        gets the full fragment; None: never for that reason.
      max_shadows: the most shadows the syncer keeps per fragment (learners at one base share
        one); a merge that would make more sends its least shared bases the full fragment.
        None: no bound (one per learner at worst).
    """

    codec: Any = None   # a codec.Codec
    error_feedback: bool = True
    full_after_versions: Optional[int] = 8
    max_shadows: Optional[int] = defaults.DOWNLINK_MAX_SHADOWS


@dataclass(frozen=True)
class FullUpdate:
    """The whole merged fragment, fp32; the learner's base becomes exact (id 0)."""

    params: Fragment
    version: int
    # The fleet's step at the merge, for a learner's inner schedule (syncer.schedule_clock:
    # fleet; merge.schedule_position); None: the learner keeps its own count.
    fleet_step: Optional[float] = None


@dataclass(frozen=True)
class DiffUpdate:
    """``codes`` of the difference (to the learner's base ``from_id``); applying them gives the
    base ``to_id`` of version ``version``."""

    codes: Mapping[str, Any]   # {path: codec.Code}
    from_id: int
    to_id: int
    version: int
    fleet_step: Optional[float] = None   # as FullUpdate's


class Shadow(NamedTuple):
    """What one learner holds of one fragment once it adopts the last update it was sent."""

    shadow_id: int
    version: int
    params: Fragment   # float32 numpy, bit for bit the learner's base


def update_bytes(update: Any) -> int:
    """Wire bytes of an update: codes as the codec counts them, a full fragment at 4 bytes per
    value (a plain ``{path: array}`` fragment counts as full)."""
    if isinstance(update, DiffUpdate):
        from . import codec as codec_lib

        return codec_lib.tree_wire_bytes(update.codes)
    params = update.params if isinstance(update, FullUpdate) else update
    return sum(int(np.asarray(v).nbytes) for v in params.values())


def apply_codes(base: Fragment, codes: Mapping[str, Any]) -> Fragment:
    """``S + decode(code)`` per tensor, in float32 numpy on the host: the one function both ends
    use, so they agree bit for bit.

    Raises:
      ValueError: the codes do not name the base's tensors, or do not fit their shapes.
    """
    from . import codec as codec_lib

    if set(codes) != set(base):
        raise ValueError(f"update names {sorted(codes)}, the base holds {sorted(base)}")
    out = {}
    for path, value in base.items():
        value = np.asarray(value, np.float32)
        delta = codec_lib.decode_host(codes[path])
        if delta.shape != value.shape:
            raise ValueError(f"{path}: update of shape {list(delta.shape)} for a base of shape "
                             f"{list(value.shape)}")
        out[path] = np.add(value, delta)
    return out


def make_update(settings: DownlinkSettings, base: Fragment, base_id: int, base_version: int,
                new: Fragment, version: int, new_id: int,
                reference: Optional[Fragment] = None) -> tuple[Any, Optional[Shadow]]:
    """The syncer's answer to one learner of a merge, and the shadow it leaves.

    Args:
      settings: the downlink settings.
      base: exactly what the learner holds (its shadow, or the global fragment of its version).
      base_id: that base's id (``EXACT`` for a global fragment).
      base_version: the version the base stands for.
      new: the merged global fragment Θ_new.
      version: its version.
      new_id: the id of the shadow this update makes (unique within the syncer).
      reference: Θ(base_version) when the syncer still has it; without error feedback the
        difference is taken to it (falls back to ``base``).

    Returns:
      ``(FullUpdate, None)`` (no shadow: the learner's base becomes exact) or
      ``(DiffUpdate, Shadow)``.
    """
    limit = settings.full_after_versions
    if settings.codec is None or (limit is not None and version - base_version > limit):
        return FullUpdate(new, version), None
    from . import codec as codec_lib

    anchor = base if settings.error_feedback or reference is None else reference
    diff = {path: np.subtract(np.asarray(new[path], np.float32),
                              np.asarray(anchor[path], np.float32)) for path in new}
    codes = codec_lib.to_numpy(codec_lib.encode_tree(settings.codec, diff))
    shadow = Shadow(new_id, version, apply_codes(base, codes))
    return DiffUpdate(codes, base_id, new_id, version), shadow


def resolve(update: Any, base: Optional[Fragment], base_id: int
            ) -> Optional[tuple[Fragment, int, int]]:
    """The learner's side: the fragment an update makes of its base.

    Args:
      update: ``FullUpdate``, ``DiffUpdate`` or a plain fragment (full).
      base: the learner's base as host arrays (only read for a ``DiffUpdate``).
      base_id: the base's id.

    Returns:
      ``(fragment, version, new base id)``, or None when a ``DiffUpdate`` was made for another
      base (the learner keeps its own; its next push is refused and re-bases on the full fragment).
      The version of a plain fragment is not known here: it comes back as -1.
    """
    if isinstance(update, DiffUpdate):
        if update.from_id != base_id or base is None:
            return None
        return apply_codes(base, update.codes), update.version, update.to_id
    if isinstance(update, FullUpdate):
        return update.params, update.version, EXACT
    return update, -1, EXACT
