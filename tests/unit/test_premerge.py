"""Regional pre-merge (link/premerge.py): the region's mean by hand-worked numbers, the home's merge
of a pre-merged push against the flat merge of the same pushes (a real SyncerCore), its books,
K and forget, the wire, the config's refusals, and a real PreMerger in front of a real core."""

import dataclasses
import threading

import numpy as np
import pytest

from islands.link import link_pb2 as pb
from islands.link import wire
from islands.link.premerge import (Encoder, PreMerger, group_push, premerge_weights,
                                   premerged_drift)
from islands.syncer import codec as C
from islands.syncer import merge as merge_lib
from islands.syncer import outer as outer_lib
from islands.syncer.actor import Reply
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.validate import Push


def _p(c_tokens, c_steps, learner="r:0"):
    return Push(learner, 0, {}, 0, 0, c_tokens, c_steps)


# -- the region's mean, by hand ---------------------------------------------------------------------
def test_weights_are_the_syncers_token_weights():
    # c_tokens² / c_steps: 100²/1 = 1e4, 300²/3 = 3e4, and a learner that did nothing: 0.
    assert premerge_weights([_p(100, 1), _p(300, 3), _p(0, 0)]) == [1e4, 3e4, 0.0]


def test_weighted_mean_by_hand_with_signs():
    a = {"w": np.array([1.0, -2.0, 4.0], np.float32)}
    b = {"w": np.array([3.0, 2.0, -4.0], np.float32)}
    # weights 1 : 3 -> (1·a + 3·b) / 4 = [10, 4, -8] / 4
    np.testing.assert_array_equal(premerged_drift([a, b], [1e4, 3e4])["w"], [2.5, 1.0, -2.0])
    # equal weights, opposite signs: they cancel
    np.testing.assert_array_equal(premerged_drift([a, {"w": -a["w"]}], [5.0, 5.0])["w"], [0, 0, 0])


def test_a_learner_with_no_tokens_counts_nothing_and_all_zero_is_the_plain_mean():
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([7.0, -7.0], np.float32)}
    np.testing.assert_array_equal(premerged_drift([a, b], [2.0, 0.0])["w"], a["w"])
    # nobody trained since the base: the plain mean, as the syncer's merge falls back to
    np.testing.assert_array_equal(premerged_drift([a, b], [0.0, 0.0])["w"], [4.0, -2.5])


def test_one_learner_is_the_identity():
    a = {"w": np.array([0.1, -3e-7, 12345.678], np.float32), "b": np.zeros((2, 2), np.float32)}
    out = premerged_drift([a], [42.0])
    assert set(out) == set(a)
    for k in a:
        np.testing.assert_array_equal(out[k], a[k])
        assert out[k].dtype == np.float32


# -- the home's merge of a pre-merged push ----------------------------------------------------------
FP32 = C.make_codec("none")


def _core(rule=merge_lib.MergeRule.MEAN, min_learners=1):
    frag = {"w": np.zeros(4, np.float32), "e": np.ones((2, 3), np.float32)}
    core = SyncerCore([frag], SyncerSettings(merge_rule=rule, min_learners=min_learners,
                                             outlier_norm_factor=None),
                      outer_lib.build("nesterov", lr=0.7, momentum=0.9),
                      lambda codes: C.decode_tree(FP32, codes))
    return core


def _drift(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(0, 0.01, 4).astype(np.float32),
            "e": rng.normal(0, 0.01, (2, 3)).astype(np.float32)}


def _push(name, seed, c_tokens, c_steps, step=1):
    codes = C.to_numpy(C.encode_tree(FP32, _drift(seed)))
    return Push(name, 0, codes, 0, 0, c_tokens, c_steps, incarnation=0, step=step,
                tokens_done=c_tokens, fates={"events": step})


PUSHES = [("far:0", 1, 64, 2), ("far:1", 2, 96, 3), ("home:0", 3, 32, 1)]


def _flat_and_grouped():
    flat, grouped = _core(), _core()
    for core in (flat, grouped):
        for name, *_ in PUSHES:
            core.register(name, 0)
    pushes = [_push(*p) for p in PUSHES]
    for p in pushes:
        assert flat.accept_push(p, 0.0).ok
    far = pushes[:2]
    mean = premerged_drift([C.decode_tree(FP32, p.codes) for p in far], premerge_weights(far))
    codes = C.to_numpy(C.encode_tree(FP32, mean))
    group = group_push("far", far, codes, C.tree_wire_bytes(codes))
    return flat, grouped, group, pushes


def test_a_premerged_push_merges_as_its_learners_pushes_and_books_each():
    flat, grouped, group, pushes = _flat_and_grouped()
    assert grouped.accept_push(group, 0.0).ok
    assert grouped.accept_push(pushes[2], 0.0).ok
    # K counts learners: the group is two of the round's three.
    assert sorted(grouped.slots[0].round) == ["far:0", "far:1", "home:0"]
    a = flat.merge(0, live_count=3)
    b = grouped.merge(0, live_count=3)
    assert a.learners == b.learners and a.version == b.version == 1
    for k in a.params:
        np.testing.assert_allclose(b.params[k], a.params[k], rtol=1e-6, atol=1e-7)
    for name, c_tokens in (("far:0", 64), ("far:1", 96), ("home:0", 32)):
        fe, ge = flat.ledger[name], grouped.ledger[name]
        assert (ge.merged_tokens_total, ge.applied_tokens, ge.applied_step, ge.fates) == (
            fe.merged_tokens_total, fe.applied_tokens, fe.applied_step, fe.fates)
        assert ge.merged_tokens_total == c_tokens


def test_quorum_counts_the_learners_a_premerged_push_carries():
    _, grouped, group, _ = _flat_and_grouped()
    core = _core(min_learners=2)
    for name, *_ in PUSHES:
        core.register(name, 0)
    assert core.accept_push(group, 5.0).ok
    decision = core.decide(0, 5.0, frozenset(["far:0", "far:1", "home:0"]), grace_s=1.0)
    assert not decision.merge and decision.reason.value == "in_grace"   # K = 2 reached
    assert core.decide(0, 6.0, frozenset(["far:0", "far:1"]), 1.0).reason.value == "all_live_in"


def test_forgetting_a_member_drops_its_group_whole():
    _, grouped, group, pushes = _flat_and_grouped()
    assert grouped.accept_push(group, 0.0).ok and grouped.accept_push(pushes[2], 0.0).ok
    dropped = grouped.forget("far:1")
    assert sorted(p.learner for p in dropped) == ["far:0", "far:1"]
    assert list(grouped.slots[0].round) == ["home:0"]
    grouped.merge(0, live_count=2)
    assert grouped.ledger["far:0"].merged_tokens_total == 0   # dropped: its learner pushes again


def test_one_refused_member_refuses_the_group_and_nothing_enters_the_round():
    _, grouped, group, _ = _flat_and_grouped()
    grouped.forget("far:0")   # not registered any more
    verdict = grouped.accept_push(group, 0.0)
    assert not verdict.ok and verdict.reason.value == "unknown_learner"
    assert "far:0" in verdict.detail and not grouped.slots[0].round


def test_rda_refuses_a_premerged_push():
    core = _core(rule=merge_lib.MergeRule.RDA)
    _, _, group, _ = _flat_and_grouped()
    for name, *_ in PUSHES:
        core.register(name, 0)
    verdict = core.accept_push(group, 0.0)
    assert not verdict.ok and "merge_rule mean" in verdict.detail


def test_a_premerged_push_crosses_the_wire():
    _, _, group, _ = _flat_and_grouped()
    back = wire.push_from_pb(wire.assemble(wire.chunks(wire.push_to_pb(group), 64),
                                           pb.PushRequest))
    assert [m.learner for m in back.members] == ["far:0", "far:1"]
    assert [(m.c_tokens, m.c_steps, m.fates) for m in back.members] == [
        (64, 2, {"events": 1}), (96, 3, {"events": 1})]
    assert all(not m.codes for m in back.members) and back.c_tokens == 160
    bad = wire.push_to_pb(group)
    bad.members[0].members.append(wire.push_to_pb(group.members[1]))
    with pytest.raises(wire.WireError, match="member carries no codes"):
        wire.push_from_pb(bad)


# -- the config ---------------------------------------------------------------------------------------
def test_config_refuses_premerge_with_rda_and_the_client_reads_both_keys():
    from islands.link.client import premerger
    from islands.orchestrator.config import ConfigError, JobConfig, parse

    regions = {"a": {"learners": 1}, "far": {"learners": 2, "remote": True}}
    with pytest.raises((ConfigError, ValueError), match="link.premerge"):
        parse({"regions": regions, "link": {"port": 0, "premerge": True}})
    job = JobConfig.model_validate({"regions": regions, "syncer": {"merge_rule": "mean"},
                                    "quorum": {"grace_cap_s": 2.5},
                                    "link": {"port": 0, "premerge": True}})
    merger = premerger(job.model_dump(), "far", send=None)
    assert merger is not None and merger.window_s == 2.5      # by default the home's grace cap
    job2 = job.model_copy(update={"link": job.link.model_copy(update={"premerge_window_s": 0.7})})
    assert premerger(job2.model_dump(), "far", send=None).window_s == 0.7
    off = job.model_copy(update={"link": job.link.model_copy(update={"premerge": False})})
    assert premerger(off.model_dump(), "far", send=None) is None


# -- a PreMerger in front of a real core --------------------------------------------------------------
class _Home:
    """A real SyncerCore answering each push as the syncer would with K = 1 and nothing else in
    the round: accepted pushes merge at once."""

    def __init__(self):
        self.core = _core()
        self.sent = []

    def send(self, push):
        self.sent.append(push)
        verdict = self.core.accept_push(push, 0.0)
        if not verdict.ok:
            params, version = self.core.fragment(0)
            return Reply("rejected", 0, 0, params, version, verdict.reason.value)
        result = self.core.merge(0, live_count=len(self.core.learners))
        return Reply("merged", 0, 0, result.params, result.version)


def _merger(home, window_s=30.0, learners=("far:0", "far:1")):
    merger = PreMerger("far", Encoder("none", 64), window_s, home.send)
    for name in learners:
        home.core.register(name, 0)
        merger.registered(name, 0)
    return merger


def _push_all(merger, pushes):
    replies = {}
    threads = [threading.Thread(target=lambda p=p: replies.__setitem__(p.learner, merger.push(p)))
               for p in pushes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return replies


def test_a_round_of_the_region_leaves_as_one_push_and_its_reply_reaches_each():
    home = _Home()
    merger = _merger(home)
    replies = _push_all(merger, [_push("far:0", 1, 64, 2), _push("far:1", 2, 96, 3)])
    assert len(home.sent) == 1 and len(home.sent[0].members) == 2
    assert {r.status.value for r in replies.values()} == {"merged"}
    assert replies["far:0"] is replies["far:1"] and replies["far:0"].version == 1
    assert home.core.ledger["far:1"].merged_tokens_total == 96
    assert merger.counts["groups"] == 1 and merger.counts["window_closes"] == 0


def test_the_window_sends_a_round_without_a_silent_learner():
    home = _Home()
    merger = _merger(home, window_s=0.3)
    replies = _push_all(merger, [_push("far:0", 1, 64, 2)])   # far:1 never pushes
    assert replies["far:0"].status.value == "merged"
    # Alone: a group of one, with its own codes as they were (nothing re-encoded).
    assert len(home.sent) == 1 and [m.learner for m in home.sent[0].members] == ["far:0"]
    assert home.sent[0].codes is not None and home.sent[0].learner == "far:premerge"
    assert merger.counts == {**merger.counts, "alone": 1, "window_closes": 1}
    assert home.core.ledger["far:0"].merged_tokens_total == 64


def test_a_forgotten_learner_is_not_waited_for():
    home = _Home()
    merger = _merger(home, window_s=60.0)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", merger.push(_push("far:0", 1, 64, 2))))
    t.start()
    merger.forgotten("far:1", 0)
    t.join(timeout=30)
    assert not t.is_alive() and out["r"].status.value == "merged"


def test_a_refused_group_falls_back_to_each_learner_alone():
    home = _Home()
    merger = _merger(home)
    home.core.forget("far:0")    # home no longer knows far:0: the group is refused whole
    replies = _push_all(merger, [_push("far:0", 1, 64, 2), _push("far:1", 2, 96, 3)])
    assert len(home.sent) == 3 and merger.counts["fallbacks"] == 1
    assert replies["far:0"].reason == "unknown_learner"
    assert replies["far:1"].status.value == "merged"
    assert home.core.ledger["far:1"].merged_tokens_total == 96


def test_a_round_whose_learners_hold_different_bases_leaves_as_one_push_per_base():
    home = _Home()
    merger = _merger(home, learners=("far:0", "far:1", "far:2"))
    home.send(_push("far:2", 9, 32, 1))   # version 1 merged: far:2 now holds it
    home.sent.clear()
    older = [_push("far:0", 1, 64, 2), _push("far:1", 2, 96, 3)]               # base 0
    newer = dataclasses.replace(_push("far:2", 3, 32, 1), base_version=1)       # base 1
    replies = _push_all(merger, older + [newer])
    assert sorted(len(p.members) for p in home.sent) == [1, 2]    # a pair from 0, one alone
    assert merger.counts["split_rounds"] == 1 and merger.counts["window_closes"] == 0
    assert {r.status.value for r in replies.values()} == {"merged"}


# -- the Syncer actor (without Ray) answers a pre-merged push ---------------------------------------
def _actor_run(body):
    import asyncio

    from islands.syncer.actor import Syncer, SyncerSpec

    spec = SyncerSpec(fragments=[{"w": np.zeros(4, np.float32), "e": np.ones((2, 3), np.float32)}],
                      settings=SyncerSettings(outlier_norm_factor=None, grace_cap_s=30.0,
                                              merge_rule=merge_lib.MergeRule.MEAN),
                      outer_kind="nesterov", outer_kwargs={}, codec_kind="none",
                      codec_block_size=64)

    async def run():
        syncer = Syncer(spec)
        regs = {name: await syncer.register(name, 0) for name, *_ in PUSHES}
        try:
            return await body(syncer, regs)
        finally:
            syncer._loop_task.cancel()

    return asyncio.run(run())


def _signed(push, regs):
    session = regs[push.learner]["session"] if push.learner in regs else ""
    return dataclasses.replace(push, session=session, members=tuple(dataclasses.replace(
                                   m, session=regs[m.learner]["session"]) for m in push.members))


def test_the_syncer_answers_a_premerged_push_once_its_round_merged():
    import asyncio

    _, _, group, pushes = _flat_and_grouped()

    async def body(syncer, regs):
        await syncer.set_fleet(100.0)   # a grace window of grace_cap_s (30 s) after the quorum
        pending = asyncio.ensure_future(syncer.push(_signed(group, regs)))
        await asyncio.sleep(0.2)
        assert not pending.done()   # K = 1, but home:0 is live and not in: the grace window
        home = await asyncio.wait_for(syncer.push(_signed(pushes[2], regs)), 30)
        merged = await asyncio.wait_for(pending, 30)
        return merged, home, await syncer.status()

    merged, home, status = _actor_run(body)
    assert (merged.status.value, merged.version) == ("merged", 1) and home.version == 1
    assert status.quorum_size == {0: 3}   # the round's learners: two in the group, one alone
    assert {n: e["merged_tokens_total"] for n, e in status.ledger.items()} == {
        "far:0": 64, "far:1": 96, "home:0": 32}


def test_forgetting_a_member_answers_the_premerged_push_dropped():
    import asyncio

    _, _, group, _ = _flat_and_grouped()

    async def body(syncer, regs):
        pending = asyncio.ensure_future(syncer.push(_signed(group, regs)))
        await asyncio.sleep(0.2)
        dropped = await syncer.forget("far:0", 0, "crash")
        return dropped, await asyncio.wait_for(pending, 30)

    dropped, reply = _actor_run(body)
    assert dropped == 2 and reply.status.value == "dropped"


# -- pre-merge with the encoded downlink ------------------------------------------------------------
def _shadowed_core():
    """A mean-merging core whose replies are int4 updates against per-learner shadows; and its
    initial fragment."""
    from islands.syncer import downlink

    frag = {"w": np.zeros(4, np.float32), "e": np.ones((2, 3), np.float32)}
    core = SyncerCore([frag], SyncerSettings(merge_rule=merge_lib.MergeRule.MEAN, min_learners=1,
                                             outlier_norm_factor=None),
                      outer_lib.build("nesterov", lr=0.7, momentum=0.9),
                      lambda codes: C.decode_tree(FP32, codes),
                      downlink=downlink.DownlinkSettings(C.make_codec("int4", 4)))
    return core, frag


def test_a_groups_members_share_one_update_and_one_shadow_so_they_premerge_again():
    """The home sends a group's members one encoded update (one shadow id); each applies it to the
    base it shares with the others, so the next round's pushes share a base again (by_base keeps
    them together) and the home accepts their next pre-merged push against that shadow."""
    from islands.link.premerge import by_base
    from islands.syncer import downlink

    core, frag = _shadowed_core()
    held = {}
    for name in ("far:0", "far:1", "home:0"):
        core.register(name, 0)
        held[name] = ({k: v.copy() for k, v in frag.items()}, 0, downlink.EXACT)
    for rnd in range(2):
        pushes = [dataclasses.replace(_push(name, 10 * rnd + i, 64 * (i + 1), i + 1, step=rnd + 1),
                                      base_version=held[name][1], base_shadow=held[name][2])
                  for i, name in enumerate(("far:0", "far:1"))]
        assert len(by_base(pushes)) == 1   # one base: one pre-merged push
        mean = premerged_drift([C.decode_tree(FP32, p.codes) for p in pushes],
                               premerge_weights(pushes))
        codes = C.to_numpy(C.encode_tree(FP32, mean))
        group = group_push("far", pushes, codes, C.tree_wire_bytes(codes))
        assert core.accept_push(group, 0.0).ok, rnd
        result = core.merge(0, live_count=2)
        updates = core.updates(result)
        assert updates["far:0"] is updates["far:1"]   # one reply fans out to both
        assert isinstance(updates["far:0"], downlink.DiffUpdate)
        assert core.shadows[("far:0", 0)] is core.shadows[("far:1", 0)]
        for name in ("far:0", "far:1"):
            base, _, base_id = held[name]
            got, version, new_id = downlink.resolve(updates[name], base, base_id)
            assert version == rnd + 1 and new_id == updates[name].to_id != downlink.EXACT
            held[name] = (got, version, new_id)
            for k in got:   # bit for bit the shadow the home keeps
                np.testing.assert_array_equal(got[k], core.shadows[(name, 0)].params[k])
    # One of them alone (a window that closed without the other) is judged on the same shadow.
    alone = dataclasses.replace(_push("far:0", 99, 32, 1, step=3), base_version=held["far:0"][1],
                                base_shadow=held["far:0"][2])
    assert core.accept_push(alone, 0.0).ok


def test_a_region_split_across_bases_gets_the_full_fragment_and_shares_a_base_again():
    """A round of the region that left as a pre-merged pair and a learner alone from another
    base (its own shadow): all three get the full fragment, so their next pushes share one
    exact base and pre-merge together; a learner of another region keeps its encoded update."""
    from islands.link.premerge import by_base
    from islands.syncer import downlink

    core, _ = _shadowed_core()
    for name in ("far:0", "far:1", "far:2", "home:0"):
        core.register(name, 0)
    # Round 1: far:2 and home:0 merge alone and get shadows of their own.
    for i, name in enumerate(("far:2", "home:0")):
        assert core.accept_push(_push(name, i, 32, 1), 0.0).ok
    first = core.updates(core.merge(0, live_count=4))
    assert all(isinstance(u, downlink.DiffUpdate) for u in first.values())
    # Round 2: far:0 + far:1 pre-merged from the exact base v1, far:2 alone from its shadow.
    pair = [dataclasses.replace(_push(n, 5 + i, 64, 2, step=2), base_version=1)
            for i, n in enumerate(("far:0", "far:1"))]
    mean = premerged_drift([C.decode_tree(FP32, p.codes) for p in pair], premerge_weights(pair))
    codes = C.to_numpy(C.encode_tree(FP32, mean))
    assert core.accept_push(group_push("far", pair, codes, C.tree_wire_bytes(codes)), 0.0).ok
    alone = dataclasses.replace(_push("far:2", 7, 32, 1, step=2), base_version=1,
                                base_shadow=first["far:2"].to_id)
    other = dataclasses.replace(_push("home:0", 8, 32, 1, step=2), base_version=1,
                                base_shadow=first["home:0"].to_id)
    assert core.accept_push(alone, 0.0).ok and core.accept_push(other, 0.0).ok
    second = core.updates(core.merge(0, live_count=4))
    for name in ("far:0", "far:1", "far:2"):
        assert isinstance(second[name], downlink.FullUpdate) and second[name].version == 2
        assert (name, 0) not in core.shadows
    assert isinstance(second["home:0"], downlink.DiffUpdate)   # not of the split region
    nxt = [dataclasses.replace(_push(n, 9, 32, 1, step=3), base_version=2)
           for n in ("far:0", "far:1", "far:2")]
    assert len(by_base(nxt)) == 1


def test_a_lone_push_refused_is_booked_once_under_its_learner():
    """A group of one refused (here: its epoch is stale) is that learner's refusal, counted
    once and named by the learner, and not sent again alone."""
    home = _Home()
    merger = _merger(home, window_s=0.2)
    stale = dataclasses.replace(_push("far:0", 1, 64, 2), epoch=5)
    reply = _push_all(merger, [stale])["far:0"]
    assert reply.reason == "stale_epoch" and len(home.sent) == 1
    assert home.core.refusals_total == 1
    assert [r["learner"] for r in home.core.refusals] == ["far:0"]
    assert merger.counts["fallbacks"] == 0
