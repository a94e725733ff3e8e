"""Issue 35, participation: every merge records who took part out of how many live learners and
how stale each push was; a learner that has not adopted the global parameters is never a peer
donor nor the only contributor of a merge. Worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.orchestrator import fleet as F
from islands.orchestrator import inprocess, metrics
from islands.orchestrator.chaos import FaultPlan, RestartCosts
from islands.orchestrator.console import participation
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.validate import Push, RejectReason


def identity_decode(codes):
    return {k: np.asarray(v, np.float32) for k, v in codes.items()}


def syncer(theta=(0.0,), names=("a", "b", "c"), **settings):
    core = SyncerCore([{"w": np.asarray(theta, np.float32)}],
                      SyncerSettings(outlier_norm_factor=None, **settings), optax.sgd(1.0),
                      identity_decode)
    for name in names:
        core.register(name, 0)
    return core


def push(core, learner, base_version, drift=0.0, step=1, incarnation=0):
    verdict = core.accept_push(Push(learner, 0, {"w": np.asarray([drift], np.float32)},
                                    base_version, core.epoch, 100, 1, incarnation=incarnation,
                                    step=step, tokens_done=100 * step), 0.0)
    assert verdict.ok, verdict
    return verdict


# -- the merge record ----------------------------------------------------------------------------
def test_full_and_partial_merges_record_participants_live_and_staleness_by_hand():
    core = syncer()
    # Round 1, every live learner from v0: 3 of 3, staleness 0 − 0 = 0 each.
    for name in "abc":
        push(core, name, 0)
    full = core.merge(0, "all_live", live_count=3)
    assert (full.version, full.participants, full.live, full.staleness) == (1, 3, 3, (0, 0, 0))
    assert full.participation == 1.0
    # Round 2, a alone (K = 1) from v1: 1 of 3, staleness 1 − 1 = 0.
    push(core, "a", 1, step=2)
    alone = core.merge(0, "quorum", live_count=3)
    assert (alone.version, alone.learners, alone.live, alone.staleness) == (2, ("a",), 3, (0,))
    assert alone.participation == pytest.approx(1 / 3)
    # Round 3 at v2: b from v1 (it has not adopted v2 yet), c from v0: staleness 1 and 2, aligned
    # with the learners (sorted); a is live but not in it: 2 of 3.
    push(core, "c", 0, step=2)
    push(core, "b", 1, step=2)
    partial = core.merge(0, "grace", live_count=3)
    assert (partial.learners, partial.staleness, partial.participants) == (("b", "c"), (1, 2), 2)
    assert partial.record() == {"fragment": 0, "version": 3, "participants": 2, "live": 3,
                                "staleness": {"b": 1, "c": 2}, "reason": "grace",
                                "refused": False}
    # The books the syncer exports: merges by "n/M", merged pushes by staleness (0: the 3 of
    # round 1 and a's; 1: b; 2: c), the live learners at the fragment's last merge.
    assert core.participation_counts == {"3/3": 1, "1/3": 1, "2/3": 1}
    assert core.staleness_counts == {0: 4, 1: 1, 2: 1}
    assert core.last_live == {0: 3}
    assert [r["participants"] for r in core.merge_records] == [3, 1, 2]


def test_a_merge_without_a_live_count_records_none_and_no_ratio():
    core = syncer()
    push(core, "a", 0)
    result = core.merge(0, "quorum")
    assert result.live is None and result.participation is None
    assert core.participation_counts == {"1/?": 1} and core.last_live == {}


# -- the sole unadopted contributor --------------------------------------------------------------
def test_a_merge_of_only_unadopted_pushes_is_refused_then_accepted_once_one_is_adopted():
    """Θ = 0 goes to v2 (a pushes +1 twice). A new worker d registers at v2: it was handed Θ(v2)
    = 2. It pushes from v0 instead (its own start, the initial weights 0, + 0.5): alone, under the
    pull rule its merge would make Θ = 0 + 0.5, its weights. Refused: Θ stays 2, v2. Its next push
    from v2 (the fragment the refusal carried) is taken, and so is a merge of an unadopted push
    with an adopted one."""
    core = syncer(names=("a",))
    push(core, "a", 0, drift=1.0)
    core.merge(0, "quorum", live_count=1)
    push(core, "a", 1, drift=1.0, step=2)
    core.merge(0, "quorum", live_count=1)
    np.testing.assert_array_equal(core.fragment(0)[0]["w"], [2.0])
    core.forget("a")   # the adopted learner dies as d comes up
    _, handed = core.register("d", 1)
    assert handed[0][1] == 2
    push(core, "d", 0, drift=0.5, incarnation=1)
    refused = core.merge(0, "quorum", live_count=1)
    assert refused.refused and refused.reason == RejectReason.UNADOPTED.value
    assert (refused.version, refused.learners, refused.live, refused.staleness) == (2, ("d",), 1,
                                                                                   (2,))
    np.testing.assert_array_equal(core.fragment(0)[0]["w"], [2.0])    # Θ kept
    assert core.versions == (2,) and core.rejected[RejectReason.UNADOPTED] == 1
    assert core.refusals[-1]["learner"] == "d" and core.refusals[-1]["reason"] == "unadopted"
    assert core.participation_counts == {"1/1": 2}   # a refused merge replaced nothing
    assert core.merge_records[-1]["refused"] is True
    assert "d" not in core.ledger or core.ledger["d"].merged_tokens_total == 0
    # d starts over from Θ(v2) = 2 and pushes +0.5 from it: merged, Θ = 2.5 (sgd lr 1, 1 of 1).
    push(core, "d", 2, drift=0.5, step=2, incarnation=1)
    accepted = core.merge(0, "quorum", live_count=1)
    assert not accepted.refused and accepted.version == 3
    np.testing.assert_allclose(core.fragment(0)[0]["w"], [2.5])
    # One adopted contribution is enough: e (new at v3) pushes from v0 with d from v3.
    core.register("e", 0)
    push(core, "e", 0, drift=0.0)
    push(core, "d", 3, drift=0.0, step=3, incarnation=1)
    mixed = core.merge(0, "quorum", live_count=2)
    assert not mixed.refused and mixed.learners == ("d", "e") and mixed.staleness == (0, 3)


def test_the_fleet_start_and_shadow_bases_are_adopted():
    core = syncer()
    assert core.adopted(Push("a", 0, {}, 0, 0, 1, 1))            # born at v0
    push(core, "a", 0, drift=1.0)
    core.merge(0, "quorum", live_count=3)
    core.register("z", 0)                                         # born at v1
    assert not core.adopted(Push("z", 0, {}, 0, 0, 1, 1))
    assert core.adopted(Push("z", 0, {}, 1, 0, 1, 1))
    assert core.adopted(Push("z", 0, {}, 0, 0, 1, 1, base_shadow=7))   # an encoded update
    assert not core.adopted(Push("z", 0, {}, 1, 0, 1, 1, incarnation=3))  # not registered


# -- the peer donor ------------------------------------------------------------------------------
def fleet_settings():
    # No prestarted process (the service's default): the restart is one Launch naming its peer.
    return F.FleetSettings(regions={"a": F.RegionPlan(3, 3, prestart=False),
                                    "b": F.RegionPlan(1, 1, prestart=False)}, min_learners=1)


def test_peer_for_never_picks_a_learner_that_has_not_adopted():
    fleet = F.step(F.initial(fleet_settings()), [], 0.0).fleet
    # All four train; only b:0 has adopted a merged fragment (a:0 and a:2 have not yet).
    beats = [F.Beat(n, 0, True, 0.1, adopted=(n == "b:0")) for n in fleet.slots]
    fleet = F.step(fleet, beats, 1.0).fleet
    assert {n: s.adopted for n, s in fleet.slots.items()} == {
        "a:0": False, "a:1": False, "a:2": False, "b:0": True}
    failed = F.step(fleet, [F.RunEnded("a:1", 0, "actor died")], 2.0).fleet
    (launch,) = F.step(failed, [], 3.0).actions
    assert launch.learner == "a:1" and launch.peer == "b:0"   # not a same-region unadopted one
    # Once a:0 adopts, it is the same-region peer; a beat without the flag does not undo it.
    fleet = F.step(fleet, [F.Beat("a:0", 0, True, adopted=True), F.Beat("a:0", 0, True)],
                   1.5).fleet
    failed = F.step(fleet, [F.RunEnded("a:1", 0, "actor died")], 2.0).fleet
    assert F.step(failed, [], 3.0).actions[0].peer == "a:0"


def test_a_restarted_learner_is_no_donor_until_it_adopts_and_none_means_a_fresh_state():
    fleet = F.step(F.initial(fleet_settings()), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat(n, 0, True, 0.1, adopted=True) for n in fleet.slots], 1.0).fleet
    failed = F.step(fleet, [F.RunEnded("b:0", 0, "actor died")], 2.0).fleet
    (launch,) = F.step(failed, [], 3.0).actions
    assert launch.peer == "a:0"
    back = F.step(F.step(failed, [], 3.0).fleet, [F.Beat("b:0", 1, True, 0.1)], 4.0).fleet
    assert back.slots["b:0"].state == F.SlotState.TRAINING and not back.slots["b:0"].adopted
    # Every a:* dies at once: b:0 (not adopted since its restart) is no donor; fresh states.
    dead = F.step(back, [F.RunEnded(n, 0, "actor died") for n in ("a:0", "a:1", "a:2")], 5.0)
    launches = [a for a in F.step(dead.fleet, [F.Beat("b:0", 1, True)], 6.0).actions
                if isinstance(a, F.Launch)]
    assert [a.peer for a in launches] == [None, None, None]


# -- the in-process driver: every other learner dies as one restarts ------------------------------
INNER = optax.adam(3e-2)
TOKENS = 16


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5}


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(p):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch_for(learner, index):
    rng = np.random.default_rng(1000 * learner + index)
    x = rng.normal(size=(TOKENS, 4)).astype(np.float32)
    return x, np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(np.float32)


def test_every_other_learner_dies_as_one_restarts_and_theta_never_takes_its_own_weights():
    """3 learners, 1 s steps, P = H = 1, τ = 0, K = 1, mean + SGD(1): a merge of one push makes Θ
    exactly that learner's weights. r:0 dies at 2.5 s and is back at 4.0 s; r:1 and r:2 die at
    4.0 s (back at 5.5 s). The restarted r:0 is a worker that kept its own start (the initial
    weights, v0) instead of the Θ its registration handed it: its first push (5.0 s) is alone in
    its merge. It is refused (``unadopted``), Θ stays as it was, r:0 starts over from Θ, and its
    later pushes merge. The books balance."""
    params = init_params()
    settings = SyncerSettings(min_learners=1, grace_cap_s=0.0, overlap_steps=0,
                              merge_rule=merge.MergeRule.MEAN, outlier_norm_factor=None,
                              history_versions=1000)
    codec = codec_lib.make_codec("none")
    core, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, 1),
        settings=settings, outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=[f"r:{i}" for i in range(3)], merge_alpha=0.0, carry_overlap=False)
    initial = {k: np.array(v) for k, v in core.slots[0].history[0].items()}
    register, merge_fn = core.register, core.merge
    own_weights, merges = [], []

    def fresh_worker_register(name, incarnation, session=None):
        epoch, frags = register(name, incarnation, session)
        if name == "r:0" and incarnation > 0:   # it keeps its own start: the initial weights
            return epoch, [({k: v.copy() for k, v in initial.items()}, 0)]
        return epoch, frags

    def watched_merge(p, reason="", live_count=None):
        before = {k: v.copy() for k, v in core.slots[p].params.items()}
        for name, c in core.slots[p].round.items():
            if name == "r:0" and c.push.incarnation > 0 and c.push.base_version == 0:
                decoded = identity_decode(codec_lib.decode_tree(codec, c.push.codes))
                own_weights.append({k: initial[k] + decoded[k] for k in initial})
        result = merge_fn(p, reason, live_count)
        merges.append((before, result))
        return result

    core.register, core.merge = fresh_worker_register, watched_merge
    plan = (FaultPlan().crash("r:0", at_s=2.5).crash("r:1", at_s=4.0).crash("r:2", at_s=4.0))
    record = inprocess.run_inprocess(
        learners=learners, syncer=core, train_step=train_step, batch_for=batch_for,
        tokens_per_batch=TOKENS, fleet=inprocess.Fleet([1.0] * 3), num_fragments=1,
        sync_every_steps=1, steps=8, faults=plan, restart=RestartCosts(restart_s=1.5),
        opt_init=INNER.init, assemble=inprocess.assemble_like(params))
    assert [(r["learner"], r["back_s"]) for r in record.restarts] == [
        ("r:0", 4.0), ("r:1", 5.5), ("r:2", 5.5)]
    refused = [(before, r) for before, r in merges if r.refused]
    assert [(r.learners, r.reason, r.live) for _, r in refused] == [(("r:0",), "unadopted", 1)]
    before, result = refused[0]
    for k in before:   # Θ kept, bit for bit
        np.testing.assert_array_equal(result.params[k], before[k])
    assert own_weights, "the restarted learner pushed from its own start"
    for _, r in merges:   # Θ never became the restarted learner's un-adopted weights
        assert not any(all(np.allclose(r.params[k], w[k]) for k in w) for w in own_weights)
    # Every merge it took part in since is from the Θ it was handed (base ≥ v at its restart).
    after = [r for _, r in merges if not r.refused and "r:0" in r.learners and r.version > 4]
    assert after and all(r.staleness[r.learners.index("r:0")] < r.version for r in after)
    assert record.rejected.get(RejectReason.UNADOPTED.value) == 1
    # The books balance: r:0's refused push is booked as dropped ("refused"), nothing is lost.
    for i, name in enumerate(record.learner_ids):
        ft = record.ledger[name]["fragment_tokens"]
        assert ft["applied"] + ft["dropped"] + ft["in_flight"] == ft["processed"], name
        entry, learner = core.ledger[name], record.learners[i]
        open_merged = sum(f.pushed.tokens for p, f in enumerate(learner.fates.fragments)
                          if entry.incarnation == learner.incarnation
                          and f.pushed_step is not None
                          and entry.merged_steps.get(p) == f.pushed_step)
        assert ft["applied"] + open_merged == entry.merged_tokens_total, name
    assert record.ledger["r:0"]["dropped_by"].get("refused", 0) == TOKENS


# -- exported --------------------------------------------------------------------------------------
def test_participation_metrics_and_console_line_by_hand():
    from prometheus_client.core import HistogramMetricFamily  # noqa: F401 (the collector's)

    spec = {s.name: s for s in metrics.METRICS}
    # 3 merges of 16 of 30 live learners, one of 30 of 30, one of 1 with M unknown.
    counts = {"16/30": 3, "30/30": 1, "1/?": 1}
    n_family, ratio_family = metrics.participation_families(counts, spec)
    n = {s.labels.get("le"): s.value for s in n_family.samples if s.name.endswith("_bucket")}
    assert n["1.0"] == 1 and n["8.0"] == 1 and n["16.0"] == 4 and n["32.0"] == 5
    assert n["+Inf"] == 5
    total = [s.value for s in n_family.samples if s.name.endswith("_sum")][0]
    assert total == 3 * 16 + 30 + 1
    r = {s.labels.get("le"): s.value for s in ratio_family.samples if s.name.endswith("_bucket")}
    # 16/30 = 0.533: above 0.5, at most 0.75; 30/30 = 1.0; the unknown M is left out.
    assert (r["0.5"], r["0.75"], r["1.0"], r["+Inf"]) == (0, 3, 4, 4)
    assert [s.value for s in ratio_family.samples if s.name.endswith("_sum")][0] == \
        pytest.approx(3 * 16 / 30 + 1.0)
    assert participation({"quorum_size": {0: 16}, "live_learners": {0: 30}}, counts) == {
        "last": {"0": "16/30"}, "merges": 5, "mean_participants": 79 / 5,
        "mean_ratio": round((3 * 16 / 30 + 1.0) / 4, 4)}
