"""The learner's pure core: counters, drift, push and adopt (docs/architecture.md#the-algorithm, learner steps 1–3).

No Ray and no clock here: the in-process driver and the LearnerUnit actor both call it between
inner steps. The train step itself lives in ``inner.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from islands import CARRY_OVERLAP
from islands.learners.fates import REFUSED, IncarnationFates
from islands.learners.inner import at_schedule_step
from islands.syncer import downlink as downlink_lib
from islands.syncer import fragments as fragments_lib
from islands.syncer.fragments import Fragment, FragmentPlan
from islands.syncer.merge import schedule_position
from islands.syncer.validate import SYNCER_DOWN, Push


def blend(local: Fragment, merged: Fragment, alpha: float) -> Fragment:
    """``θ ← α·θ_local + (1 − α)·Θ``; α = 0 (the paper) adopts the merged fragment as is.

    The result lives on the default device (the learner's accelerator), like the parameters.

    >>> np.asarray(blend({"w": np.array([2.0])}, {"w": np.array([4.0])}, 0.5)["w"])
    array([3.], dtype=float32)
    """
    if alpha == 0.0:
        return {path: jnp.asarray(value, jnp.float32) for path, value in merged.items()}
    return {path: alpha * jnp.asarray(local[path], jnp.float32)
            + (1.0 - alpha) * jnp.asarray(merged[path], jnp.float32) for path in merged}


@dataclass
class FragmentTrack:
    """What a learner knows about one fragment since it last adopted it."""

    base: Fragment                 # Θ[p](base_version), the anchor of the drift (on the device)
    base_version: int
    ef_state: Any                  # error-feedback residual, committed when a push is merged
    c_tokens: int = 0
    c_steps: int = 0
    in_flight_since_step: Optional[int] = None
    pending_ef_state: Any = None
    reply: Optional[tuple[Fragment, int]] = None
    resend: bool = False           # re-based after a refusal: push again at the next step
    base_id: int = 0               # the syncer's id of this base (syncer/downlink.py; 0: exact)
    base_host: Optional[Fragment] = None   # the base as host arrays, once the learner has them
    # Carry mode: the local fragment and counters at the open push, so adoption can keep the
    # steps taken since (Θ_new + (θ_now − θ_at_push)) instead of overwriting them.
    local_at_push: Optional[Fragment] = None
    pushed_counts: tuple[int, int] = (0, 0)


@dataclass
class PushPlan:
    """A push ready to send, and the bytes it takes on the wire.

    The codes and the relative error may still be device values being computed (``make_push``
    only dispatches the encode); ``on_host()`` waits for them and copies them to the host, which
    the Ray learner's sender thread does off the training thread's path."""

    push: Push
    wire_bytes: int
    relative_error: Any

    def on_host(self) -> "PushPlan":
        codes = jax.device_get(self.push.codes)
        return PushPlan(dataclasses.replace(self.push, codes=codes), self.wire_bytes,
                        float(self.relative_error))


# Refusals that say nothing about the drift itself: keep it and push again after re-registering.
RESEND_REASONS = frozenset({"stale_epoch", "unknown_learner", "bad_session", SYNCER_DOWN,
                            "dropped"})
# Refusals of a sound drift against an anchor the syncer no longer has (or a round it already
# holds): re-base the drift on the global fragment that rides along and push it again at once.
REBASE_REASONS = frozenset({"unknown_version", "duplicate", "too_stale"})


class LearnerCore:
    """One learner's parameters, inner optimizer state and per-fragment sync bookkeeping.

    Args:
      learner: id, "us-east:0".
      params: initial parameters (a pytree), normally the syncer's global Θ.
      opt_state: inner optimizer state.
      plan: the fragment plan shared with the syncer.
      versions: the global version of each fragment in ``params``.
      error_feedback: optax-shaped ``init(tree)`` / ``update(drift, state) -> (codes, state)``.
      wire_bytes: counts the encoded bytes of a codes tree.
      decode: decodes a codes tree (for the relative-error metric).
      overlap_steps: τ, a reply is adopted no earlier than τ steps after its push.
      merge_alpha: α of the blend (only without ``carry_overlap``).
      carry_overlap: adopt ``Θ_new + (θ_now − θ_at_push)``: the τ steps between a push and the
        adoption of its merge stay as drift for the next push instead of being overwritten.
      incarnation: restart count of this learner id.
      start_step: the step this incarnation resumes at (its shard resumes at the same batch).
      place: puts a fragment (host or device arrays) where the parameters live, as float32: by
        default the default device; a multi-device learner slices it over its mesh
        (``mesh.Layout.place_fragment``), so bases, drifts and residuals stay sharded.
    """

    def __init__(self, learner: str, params: Any, opt_state: Any, plan: FragmentPlan,
                 versions: list[int], error_feedback: Any, wire_bytes: Callable[[Any], int],
                 decode: Callable[[Any], Fragment], overlap_steps: int = 2,
                 merge_alpha: float = 0.0, incarnation: int = 0, start_step: int = 0,
                 session: str = "", carry_overlap: bool = CARRY_OVERLAP,
                 place: Optional[Callable[[Fragment], Fragment]] = None):
        self.learner = learner
        self.params = params
        self.opt_state = opt_state
        self.plan = plan
        self.error_feedback = error_feedback
        self.wire_bytes = wire_bytes
        self.decode = decode
        self.overlap_steps = overlap_steps
        self.merge_alpha = merge_alpha
        self.carry_overlap = carry_overlap
        self.place = place if place is not None else on_device
        self.incarnation = incarnation
        self.session = session     # the syncer's token for this incarnation ("" when unchecked)
        self.step = start_step
        self.tokens_done = 0       # this incarnation
        self.compute_s = 0.0       # this incarnation's inner-step seconds
        self.fates = IncarnationFates(plan.num_fragments)  # where each step's tokens went
        # Merged global fragments adopted by this incarnation (adopt_ready): above 0, it has
        # adopted the cluster's Θ since it started (``has_adopted``; the heartbeat's ``adopted``).
        self.merges_adopted = 0
        self.tracks = []
        for p in range(plan.num_fragments):
            base = self.place(fragments_lib.extract(params, plan, p))
            self.tracks.append(FragmentTrack(base=base, base_version=versions[p],
                                             ef_state=self._placed_residual(
                                                 error_feedback.init(base))))
        # Drift, encode (with error feedback) and the encoding's relative error in one compiled
        # call on the device that holds the parameters; only the codes go to the host. Taking
        # the fp32 fragment to the host and encoding it in numpy cost half a step on a GPU
        # (docs/architecture.md#learners-on-accelerators).
        self._encode_drift = _compiled_encode_drift(error_feedback, decode)

    def _placed_residual(self, ef_state: Any) -> Any:
        """The error-feedback state with its residual (a fragment-shaped tree) laid out like the
        fragment: the codec makes it on the default device."""
        if self.place is on_device or not hasattr(ef_state, "residual"):
            return ef_state
        return ef_state._replace(residual=self.place(ef_state.residual))

    def compile_pushes(self) -> None:
        """Compiles every fragment's encode (and, with ``carry_overlap``, its adoption) now,
        before training, so the first pushes and adoptions do not stall steps (a straggler check
        would see them: a learner whose first carries compiled was restarted as a straggler)."""
        for p, track in enumerate(self.tracks):
            local = fragments_lib.extract(self.params, self.plan, p)
            jax.block_until_ready(self._encode_drift(local, track.base, track.ef_state))
            if self.carry_overlap:
                jax.block_until_ready(_carry(track.base, local, local))

    # -- step 1: after every inner step --------------------------------------------------------
    def record_step(self, tokens: int, step_s: float) -> None:
        self.step += 1
        self.tokens_done += tokens
        self.compute_s += step_s
        self.fates.step(tokens, step_s)
        for track in self.tracks:
            track.c_tokens += tokens
            track.c_steps += 1

    def add_step_seconds(self, seconds: float) -> None:
        """Step time counted after the step's pushes left (their hand-over is step time)."""
        self.compute_s += seconds
        self.fates.add_seconds(seconds)

    # -- step 2: push a due fragment -------------------------------------------------------------
    def due(self, num_fragments: int, sync_every_steps: int) -> list[int]:
        """Fragments due after the current step, skipping those whose last push is unanswered."""
        due = set(fragments_lib.due_fragments(self.step, num_fragments, sync_every_steps))
        return [p for p, track in enumerate(self.tracks)
                if (p in due or track.resend) and track.in_flight_since_step is None]

    def drift(self, p: int) -> Fragment:
        """``δ = θ_m[p] − Θ[p](v_base)``, as host arrays."""
        local = fragments_lib.extract(self.params, self.plan, p)
        base = self.tracks[p].base
        return {path: np.asarray(jnp.asarray(local[path], jnp.float32) - base[path])
                for path in base}

    def make_push(self, p: int, epoch: int | Sequence[int]) -> PushPlan:
        """``epoch``: the syncer's epoch, or per fragment the epoch of the syncer shard that owns
        it (syncer/shards.py)."""
        if not isinstance(epoch, int):
            epoch = int(epoch[p])
        track = self.tracks[p]
        local = fragments_lib.extract(self.params, self.plan, p)
        # Dispatched, not waited for: the codes (and the error metric) reach the host when the
        # caller asks (PushPlan.on_host), so the next inner step can start meanwhile.
        codes, new_ef_state, err = self._encode_drift(local, track.base, track.ef_state)
        track.pending_ef_state = new_ef_state
        track.in_flight_since_step = self.step
        if self.carry_overlap:
            track.local_at_push = local
            track.pushed_counts = (track.c_tokens, track.c_steps)
        track.resend = False
        self.fates.pushed(p, self.step)
        nbytes = self.wire_bytes(codes)
        push = Push(learner=self.learner, fragment=p, codes=codes,
                    base_version=track.base_version, epoch=epoch, c_tokens=track.c_tokens,
                    c_steps=track.c_steps, incarnation=self.incarnation, step=self.step,
                    tokens_done=self.tokens_done, compute_s=self.compute_s, wire_bytes=nbytes,
                    session=self.session, base_shadow=track.base_id,
                    fates=self.fates.to_json())
        return PushPlan(push, nbytes, err)

    def push_refused(self, p: int, fragment: Optional[Fragment] = None,
                     version: Optional[int] = None) -> None:
        """The syncer refused the push. With the current global fragment at hand, start over from
        it (the refused drift and the error-feedback residual are dropped: pushing them again would
        be refused again and only grow); otherwise keep the counters and the residual and try
        again at the next due step."""
        track = self.tracks[p]
        track.in_flight_since_step = None
        track.pending_ef_state = None
        track.local_at_push = None
        track.reply = None
        if fragment is not None and version is not None:
            self.fates.discarded(p, REFUSED)
            self.adopt(p, fragment, version)
            # Starting over means the error-feedback residual too: it rides in every push until
            # one merges, so a residual the syncer refuses (say, the rounding error of a push
            # that spanned a long partition, large against a few steps' drift) would get every
            # following push refused as an outlier, and the learner quarantined.
            track.ef_state = self._placed_residual(self.error_feedback.init(track.base))
        else:
            self.fates.returned(p)

    def refused(self, p: int, reason: str, fragment: Optional[Fragment] = None,
                version: Optional[int] = None) -> None:
        """The one refusal rule of every driver. A push the syncer could not judge (it was sent
        to an earlier syncer epoch, its incarnation is not registered there, the syncer was
        down, or the learner was forgotten) keeps its drift and goes again at the next due step,
        after the driver re-registers; any other refusal starts over from the current global
        fragment that rides along with it."""
        if reason in RESEND_REASONS:
            self.push_refused(p)
        elif reason in REBASE_REASONS and fragment is not None and version is not None:
            self.rebase(p, fragment, version)
        else:
            self.push_refused(p, fragment, version)

    def rebase(self, p: int, fragment: Fragment, version: int) -> None:
        """Re-anchors fragment p's drift on the global fragment Θ[p](version): the local values
        become ``Θ[p](version) + δ``, so no inner step is lost, and the counters keep counting
        the steps the drift carries. The fragment is pushed again at the next step."""
        track = self.tracks[p]
        local = fragments_lib.extract(self.params, self.plan, p)
        base = self.place(fragment)
        moved = {path: base[path] + (jnp.asarray(local[path], jnp.float32) - track.base[path])
                 for path in base}
        self.params = fragments_lib.insert(self.params, self.plan, p, moved)
        track.base, track.base_version = base, version
        track.base_id, track.base_host = downlink_lib.EXACT, None
        track.in_flight_since_step = None
        track.pending_ef_state = None
        track.local_at_push = None
        track.reply = None
        track.resend = True
        self.fates.returned(p)

    def reregistered(self, fragments: list[Fragment], versions: list[int],
                     session: str = "", fragment_ids: Optional[Sequence[int]] = None) -> None:
        """Joined a restarted syncer (a new epoch): every fragment's anchor becomes the global
        fragment it now holds; local progress stays as drift, unanswered pushes are void.
        ``fragment_ids``: the global ids of ``fragments`` when one syncer shard restarted (the
        other shards' fragments are untouched); None: all fragments, in order."""
        self.session = session
        ids = range(len(self.tracks)) if fragment_ids is None else fragment_ids
        for p, fragment, version in zip(ids, fragments, versions):
            track = self.tracks[p]
            self.fates.returned(p)
            track.base = self.place(fragment)
            track.base_version = version
            track.base_id, track.base_host = downlink_lib.EXACT, None
            track.in_flight_since_step = None
            track.reply = None
            track.pending_ef_state = None
            track.local_at_push = None

    # -- step 3: adopt a merged fragment ----------------------------------------------------------
    def offer_reply(self, p: int, fragment: Any, version: int) -> None:
        """The answer to this learner's push has arrived (the merged fragment, or a
        ``downlink.FullUpdate`` / ``DiffUpdate``); adopt when due."""
        self.tracks[p].reply = (fragment, version)

    def adopt_ready(self) -> list[int]:
        """Adopts every arrived reply whose push is at least τ steps old; returns the fragments."""
        adopted = []
        for p, track in enumerate(self.tracks):
            if track.reply is None or track.in_flight_since_step is None:
                continue
            if self.step < track.in_flight_since_step + self.overlap_steps:
                continue
            fragment, version = track.reply
            self.fates.merged(p)        # the merge included its push
            if not self.carry_overlap:
                self.fates.overwritten(p)   # the steps since the push are replaced
            self.adopt(p, fragment, version, carry=self.carry_overlap)
            adopted.append(p)
        self.merges_adopted += len(adopted)
        return adopted

    @property
    def has_adopted(self) -> bool:
        """Whether this incarnation adopted a merged global fragment since it started: until then
        it is no peer donor of its inner state (``fleet.peer_for``)."""
        return self.merges_adopted > 0

    def adopt(self, p: int, fragment: Any, version: int, carry: bool = False) -> None:
        """Takes fragment p from the syncer: a merged fragment or a downlink update of it, which
        is applied on the host to this learner's base exactly as the syncer applied it to its
        shadow. An encoded update made for another base is not applied (it cannot be: the
        learner keeps its base, and the syncer refuses its next push and sends the full
        fragment to re-base on). ``carry``: the answer to this learner's open push; the steps
        taken since that push are kept on top of it (and stay in the drift and counters)."""
        track = self.tracks[p]
        fleet = getattr(fragment, "fleet_step", None)   # syncer.schedule_clock: fleet
        host = track.base_host
        if isinstance(fragment, downlink_lib.DiffUpdate) and host is None:
            host = {path: np.asarray(value, np.float32) for path, value in track.base.items()}
        resolved = downlink_lib.resolve(fragment, host, track.base_id)
        if resolved is None:
            self.push_refused(p)
            return
        fragment, sent_version, base_id = resolved
        version = sent_version if sent_version >= 0 else version
        track.base_id = base_id
        track.base_host = fragment if base_id != downlink_lib.EXACT else None
        base = self.place(fragment)  # one host-to-device copy, shared by base and parameters
        carried = track.local_at_push if carry else None
        if carried is not None:
            local = fragments_lib.extract(self.params, self.plan, p)
            new_local = _carry(base, local, carried)
        elif self.merge_alpha == 0.0:
            new_local = base
        else:
            new_local = blend(fragments_lib.extract(self.params, self.plan, p), base,
                              self.merge_alpha)
        self.params = fragments_lib.insert(self.params, self.plan, p, new_local)
        track.base = base
        track.base_version = version
        if track.pending_ef_state is not None:
            track.ef_state = track.pending_ef_state
        track.pending_ef_state = None
        if carried is not None:   # the counters keep the steps since the push
            track.c_tokens -= track.pushed_counts[0]
            track.c_steps -= track.pushed_counts[1]
        else:
            track.c_tokens = 0
            track.c_steps = 0
        if fleet is not None:   # the inner schedule follows the fleet, not this learner's steps
            self.opt_state = at_schedule_step(
                self.opt_state, schedule_position(fleet, track.in_flight_since_step, self.step))
        track.local_at_push = None
        track.pushed_counts = (0, 0)
        track.in_flight_since_step = None
        track.reply = None

    @property
    def versions(self) -> list[int]:
        return [track.base_version for track in self.tracks]


@functools.lru_cache(maxsize=32)
def _compiled_encode_drift(error_feedback: Any, decode: Callable[[Any], Fragment]):
    """The push's compiled call, one per (error feedback, decode) pair: a restarted incarnation
    that reuses its predecessor's codec reuses its compiled program too (a jit per instance
    compiled again at every restart: 0.9 s of CPU each in the in-process soak replay)."""

    def encode_drift(local: Fragment, base: Fragment, ef_state: Any):
        drift = {path: (jnp.asarray(local[path], jnp.float32) - base[path]) for path in base}
        codes, new_ef_state = error_feedback.update(drift, ef_state)
        return codes, new_ef_state, relative_error(drift, decode(codes))

    return jax.jit(encode_drift)


@jax.jit
def _carry(merged: Fragment, local: Fragment, local_at_push: Fragment) -> Fragment:
    """``Θ_new + (θ_now − θ_at_push)``: the merged fragment plus the steps taken since the push.

    >>> np.asarray(_carry({"w": np.array([4.0])}, {"w": np.array([2.5])},
    ...                   {"w": np.array([2.0])})["w"]).tolist()
    [4.5]
    """
    return {path: merged[path] + (jnp.asarray(local[path], jnp.float32)
                                  - jnp.asarray(local_at_push[path], jnp.float32))
            for path in merged}


def to_numpy(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float32), tree)


def on_device(tree: Any) -> Any:
    """float32 jax arrays on the default device (copies host arrays there once)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=jnp.float32), tree)


def relative_error(exact: Fragment, approx: Fragment) -> jax.Array:
    """``‖approx − exact‖ / ‖exact‖`` over a whole fragment (0 when exact is 0); jittable.

    >>> round(float(relative_error({"w": np.array([3.0, 4.0])}, {"w": np.array([3.0, 4.5])})), 6)
    0.1
    """
    num = sum(jnp.sum(jnp.square(jnp.asarray(approx[k], jnp.float32)
                                 - jnp.asarray(exact[k], jnp.float32))) for k in exact)
    den = sum(jnp.sum(jnp.square(jnp.asarray(exact[k], jnp.float32))) for k in exact)
    return jnp.where(den > 0, jnp.sqrt(num / jnp.where(den > 0, den, 1.0)), 0.0)
