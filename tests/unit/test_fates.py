"""Honest books: every fragment-token of every inner step has exactly one fate, counted where it
happens (learners/fates.py, orchestrator/books.py), worked by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from islands.learners.core import LearnerCore
from islands.learners.fates import IncarnationFates, newest
from islands.orchestrator.books import Books, Fates
from islands.syncer import codec as codec_lib
from islands.syncer import fragments


def totals(f):
    t = f.totals()
    return t["processed"], t["applied"], t["dropped"], t["in_flight"], t["dropped_by"]


def test_every_transition_by_hand():
    f = IncarnationFates(2)
    f.step(8, 1.0)                       # both fragments: 8 in the drift
    f.pushed(0, step=1)                  # fragment 0's 8 ride in a push
    f.step(8, 1.0)                       # 8 more each: drift 8 (frag 0), 16 (frag 1)
    assert totals(f) == (32, 0, 0, 32, {})
    f.merged(0)                          # its merge included the push: 8 applied
    f.overwritten(0)                     # adoption overwrites the 8 since the push (α = 0)
    assert totals(f) == (32, 8, 8, 16, {"overlap": 8})
    f.pushed(1, step=2)                  # fragment 1's 16 in a push...
    f.returned(1)                        # ...not judged (syncer down): drift again
    f.pushed(1, step=3)
    f.discarded(1, "refused")            # refused as garbage: starts over, 16 dropped
    assert totals(f) == (32, 8, 24, 0, {"overlap": 8, "refused": 16})
    assert f.balanced()
    # seconds travel with the tokens: 1 s of each of the 2 steps per fragment
    assert f.totals()["applied_s"] == pytest.approx(1.0)
    assert f.totals()["processed_s"] == pytest.approx(4.0)


def test_settle_credits_an_open_push_the_syncer_merged_and_drops_the_rest():
    f = IncarnationFates(2)
    f.step(10, 1.0); f.pushed(0, step=1); f.pushed(1, step=1); f.step(10, 1.0)
    unmerged = IncarnationFates.from_json(f.to_json())
    f.settle("crash", merged_steps={0: 1, 1: 0})  # fragment 1's last merge was an older push
    assert totals(f) == (40, 10, 30, 0, {"crash": 30})
    unmerged.settle("crash", merged_steps={})
    assert totals(unmerged) == (40, 0, 40, 0, {"crash": 40})


def test_newest_copy_wins_and_json_round_trips():
    f = IncarnationFates(3)
    beat = f.to_json()
    f.step(4, 0.5); f.pushed(2, step=1)
    push = f.to_json()
    assert newest(beat, push, None) == push and newest(None) is None
    assert IncarnationFates.from_json(push).to_json() == push


def test_books_settle_a_dead_incarnation_and_add_the_live_one():
    books = Books(num_fragments=2)
    dead = IncarnationFates(2)
    dead.step(10, 1.0); dead.pushed(0, step=1); dead.step(10, 1.0)
    assert books.close_incarnation("a:0", dead.to_json(), {0: 1}, "preemption") == 30
    live = IncarnationFates(2)
    live.step(10, 2.0)
    total = books.tokens({"a:0": live.to_json()})
    assert (total.processed, total.applied, total.dropped, total.in_flight) == (60, 10, 30, 20)
    assert total.dropped_by == {"preemption": 30} and total.balanced()
    as_tokens = total.as_dict(2)
    assert (as_tokens["processed"], as_tokens["applied"]) == (30.0, 5.0)
    assert books.useful_s({"a:0": live.to_json()}) == pytest.approx(0.5)  # 1 fragment-second / 2
    assert Books.from_json(books.to_json()).tokens({}).dropped_by == {"preemption": 30}
    # an unbalanced total is caught, not hidden
    assert not Fates(processed=10, applied=5, dropped=1, in_flight=3, dropped_by={"x": 1}).balanced()


def _core(P=2):
    params = {"a": jnp.zeros(3), "b": jnp.ones(2)}
    plan = fragments.partition(params, P)
    codec = codec_lib.make_codec("none")
    return LearnerCore("r:0", params, None, plan, [0] * P, codec_lib.error_feedback(codec),
                       codec_lib.tree_wire_bytes, lambda c: codec_lib.decode_tree(codec, c),
                       overlap_steps=1, carry_overlap=False)  # the overlap fate: overwrite


def test_learner_core_moves_tokens_with_its_pushes_refusals_and_adoptions():
    core = _core()
    core.record_step(8, 0.1)
    plan = core.make_push(0, epoch=0)
    assert plan.push.fates["fragments"][0]["pushed"][0] == 8     # the push carries its books
    core.record_step(8, 0.1)
    frag0 = {k: np.asarray(v) for k, v in fragments.extract(core.params, core.plan, 0).items()}
    core.offer_reply(0, frag0, 1)
    assert core.adopt_ready() == [0]
    assert totals(core.fates) == (32, 8, 8, 16, {"overlap": 8})
    # a re-based push keeps its work as drift; a garbage refusal drops it
    core.make_push(1, epoch=0)
    frag1 = {k: np.asarray(v) for k, v in fragments.extract(core.params, core.plan, 1).items()}
    core.refused(1, "unknown_version", frag1, 3)
    assert totals(core.fates)[3] == 16
    core.make_push(1, epoch=0)
    core.refused(1, "outlier_norm", frag1, 3)
    assert totals(core.fates) == (32, 8, 24, 0, {"overlap": 8, "refused": 16})
    # the merge weights' counters are exactly the fragment's tokens still in flight
    for track, f in zip(core.tracks, core.fates.fragments):
        assert track.c_tokens == f.drift.tokens + f.pushed.tokens


def test_carry_overlap_keeps_the_steps_since_the_push_and_their_tokens():
    """overlap: carry adopts Θ_new + (θ_now − θ_at_push), by hand on one fragment of 3 values:
    base 0, pushed at θ = (1, 2, 3), one more step to θ = (1.5, 2, 2), merged Θ_new = (10, 20,
    30) → θ = (10.5, 20, 29); the next drift is (0.5, 0, −1) with the one step's 8 tokens."""
    core = _core(P=1)
    core.carry_overlap = True
    core.params = {"a": jnp.array([1.0, 2.0, 3.0]), "b": core.params["b"]}
    core.tracks[0].base = {"a": jnp.zeros(3), "b": jnp.ones(2)}
    core.record_step(8, 0.1)
    pushed = core.make_push(0, epoch=0)
    np.testing.assert_array_equal(np.asarray(pushed.push.codes["a"].payload), [1.0, 2.0, 3.0])
    core.params = {"a": jnp.array([1.5, 2.0, 2.0]), "b": core.params["b"]}
    core.record_step(8, 0.1)
    core.offer_reply(0, {"a": np.array([10.0, 20.0, 30.0]), "b": np.array([1.0, 1.0])}, 1)
    assert core.adopt_ready() == [0]
    np.testing.assert_array_equal(np.asarray(core.params["a"]), [10.5, 20.0, 29.0])
    np.testing.assert_array_equal(np.asarray(core.drift(0)["a"]), [0.5, 0.0, -1.0])
    assert (core.tracks[0].c_tokens, core.tracks[0].c_steps) == (8, 1)
    assert core.tracks[0].local_at_push is None
    # nothing is dropped as overlap: 8 applied, the carried 8 still in flight
    assert totals(core.fates) == (16, 8, 0, 8, {})
    assert core.fates.balanced()
