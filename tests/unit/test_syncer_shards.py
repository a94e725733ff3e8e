"""Syncer shards: the fragment assignment, global <-> local ids, the combined status, and a shard
killed and restored alone (the real Syncer actor class, driven directly on an asyncio loop)."""

import asyncio

import numpy as np
import pytest

from islands.syncer import codec as codec_lib
from islands.syncer.actor import Syncer, SyncerSpec
from islands.syncer.core import SyncerSettings
from islands.syncer.shards import (ShardMap, assign_fragments, combine_status, localize,
                                   localize_adopted, shard_snapshot_dir, shard_specs,
                                   syncer_shard_name)
from islands.syncer.validate import Push


# -- the assignment ---------------------------------------------------------------------------------
def test_assignment_is_largest_first_to_the_lightest_shard():
    # sizes 4,3,3,2,2 over 2 shards: 4->s0 (4); 3->s1 (3); 3->s1 (6, since 3 < 4); 2->s0 (6);
    # 2 -> tie 6/6 -> the lower shard s0 (8). Loads 8 and 6.
    assert assign_fragments([4, 3, 3, 2, 2], 2) == ((0, 3, 4), (1, 2))
    assert assign_fragments([7, 1, 1, 5], 2) == ((0,), (1, 2, 3))
    # One shard owns everything, in order; S = P gives one fragment each.
    assert assign_fragments([5, 9, 1], 1) == ((0, 1, 2),)
    assert assign_fragments([5, 9, 1], 3) == ((1,), (0,), (2,))
    # Deterministic: equal sizes round-robin by id.
    assert assign_fragments([1] * 6, 4) == ((0, 4), (1, 5), (2,), (3,))


def test_assignment_refuses_bad_input_naming_it():
    with pytest.raises(ValueError, match=r"syncer shards \(0\) must be >= 1"):
        assign_fragments([1, 2], 0)
    with pytest.raises(ValueError, match=r"syncer shards \(3\) exceed fragments \(2\)"):
        assign_fragments([1, 2], 3)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        assign_fragments([1, -2], 1)


def test_shard_map_and_ids():
    m = ShardMap(((0, 3, 4), (1, 2)))
    assert [m.shard_of(p) for p in range(5)] == [0, 1, 1, 0, 0]
    assert [m.local(p) for p in range(5)] == [0, 0, 1, 1, 2]
    assert m.to_global(0, 2) == 4 and m.to_global(1, 1) == 2
    assert ShardMap.single(3).owned == ((0, 1, 2),)
    with pytest.raises(ValueError, match="exactly once"):
        ShardMap(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match=r"fragment 7 not in \[0, 5\)"):
        m.shard_of(7)
    assert localize((1, 2), 2) == 1 and localize((1, 2), 0) == -1 and localize(None, 5) == 5
    adopted = [("v0",), ("v1",), ("v2",)]
    assert localize_adopted((0, 2), adopted) == [("v0",), ("v2",)]
    assert syncer_shard_name(0) == "islands:syncer" and syncer_shard_name(1) == "islands:syncer-1"
    assert shard_snapshot_dir("/r/syncer/", 1) == "/r/syncer-shard-1"
    assert shard_snapshot_dir(None, 1) is None


def test_config_field_and_its_checks():
    from islands.orchestrator.config import ConfigError, JobConfig

    base = {"name": "t", "regions": {"a": {"learners": 2}}}
    assert JobConfig.model_validate(base).syncer.shards == 1
    cfg = JobConfig.model_validate({**base, "syncer": {"fragments": 4, "shards": 2}})
    assert cfg.syncer.shards == 2
    with pytest.raises(Exception, match=r"syncer shards \(5\) exceed fragments \(4\)"):
        JobConfig.model_validate({**base, "syncer": {"fragments": 4, "shards": 5}})
    remote = {**base, "regions": {"a": {"learners": 1}, "b": {"learners": 1, "remote": True}},
              "link": {"port": 50000}, "syncer": {"fragments": 4, "shards": 2}}
    assert JobConfig.model_validate(remote).syncer.shards == 2   # the link routes by fragment
    assert ConfigError  # the CLI reports these as a ConfigError naming the field


# -- the combined status --------------------------------------------------------------------------
def test_combined_status_sums_counts_and_keeps_each_fragments_owner():
    s0 = {"epoch": 0, "versions": [3, 1], "merges": 4, "merges_by_fragment": {0: 3, 3: 1},
          "quorum_size": {0: 2}, "rejected": {"outlier_norm": 1}, "staleness_counts": {0: 4},
          "registered": {"a": 0}, "quarantined": {}, "refusals_total": 1,
          "wire_bytes_up": {"a": 100}, "wire_bytes_down": {"a": 10}, "fragment_ids": [0, 3],
          "syncer_shard": 0,
          "ledger": {"a": {"incarnation": 0, "applied_tokens": 640, "applied_step": 10,
                           "applied_tokens_incarnation": 640, "applied_compute_s": 1.0,
                           "applied_compute_incarnation_s": 1.0, "merged_steps": {0: 10, 3: 8},
                           "merged_tokens_total": 500, "fates": {"events": 7}}}}
    s1 = {"epoch": 2, "versions": [5, 2], "merges": 7, "merges_by_fragment": {1: 5, 2: 2},
          "quorum_size": {1: 1}, "rejected": {"outlier_norm": 2, "stale_epoch": 3},
          "staleness_counts": {0: 5, 1: 2}, "registered": {"a": 0}, "quarantined": {},
          "refusals_total": 5, "wire_bytes_up": {"a": 50}, "wire_bytes_down": {"a": 5},
          "fragment_ids": [1, 2], "syncer_shard": 1,
          "ledger": {"a": {"incarnation": 0, "applied_tokens": 704, "applied_step": 11,
                           "applied_tokens_incarnation": 704, "applied_compute_s": 1.1,
                           "applied_compute_incarnation_s": 1.1, "merged_steps": {1: 11, 2: 9},
                           "merged_tokens_total": 300, "fates": {"events": 9}}}}
    out = combine_status([s0, s1])
    assert out["versions"] == [3, 5, 2, 1]            # fragment p's version, from its owner
    assert out["merges"] == 11 and out["epoch"] == 2
    assert out["rejected"] == {"outlier_norm": 3, "stale_epoch": 3}
    assert out["staleness_counts"] == {0: 9, 1: 2}
    assert out["wire_bytes_up"] == {"a": 150} and out["refusals_total"] == 6
    entry = out["ledger"]["a"]
    assert entry["merged_steps"] == {0: 10, 3: 8, 1: 11, 2: 9}
    assert entry["merged_tokens_total"] == 800 and entry["applied_step"] == 11
    assert entry["fates"] == {"events": 9}
    assert [(r["shard"], r["epoch"], r["fragments"], r["merges"]) for r in out["shards"]] == [
        (0, 0, [0, 3], 4), (1, 2, [1, 2], 7)]
    # One shard: its status as it is, plus its row.
    single = combine_status([s0])
    assert single["versions"] == [3, 1] and single["shards"][0]["merges"] == 4
    # A shard that could not answer adds nothing.
    assert combine_status([s0, None])["merges"] == 4


# -- shards of a real syncer ----------------------------------------------------------------------
CODEC = codec_lib.make_codec("none")


def _spec(tmp_path, every=2, journal=False):
    frags = [{"w0": np.ones(8, np.float32)}, {"w1": np.ones(6, np.float32)},
             {"w2": np.ones(4, np.float32)}, {"w3": np.ones(2, np.float32)}]
    settings = SyncerSettings(min_learners=2, outlier_norm_factor=None, grace_cap_s=0.0)
    return SyncerSpec(fragments=frags, settings=settings, outer_kind="nesterov", outer_kwargs={},
                      codec_kind="none", codec_block_size=64,
                      checkpoint_dir=str(tmp_path / "syncer"), snapshot_every_merges=every,
                      journal=journal)   # off: these tests exercise the learners' catch-up


def _push(learner, p, value, size, version, epoch, session, step):
    drift = {f"w{p}": np.full(size, value, np.float32)}
    return Push(learner, p, codec_lib.encode_tree(CODEC, drift), version, epoch, 64, 2,
                step=step, tokens_done=64 * step, session=session)


SIZES = [8, 6, 4, 2]


async def _round(syncer, reg, p, version, step, value=-0.25):
    """Both learners push fragment p; returns their replies (the merge answers both)."""
    return await asyncio.wait_for(asyncio.gather(*[
        syncer.push(_push(name, p, value * (1 + i), SIZES[p], version, reg[name]["epoch"],
                          reg[name]["session"], step))
        for i, name in enumerate(("a", "b"))]), timeout=30)


def test_shard_specs_split_fragments_and_snapshots(tmp_path):
    spec = _spec(tmp_path)
    assert shard_specs(spec, 1) == [spec]
    s0, s1 = shard_specs(spec, 2)   # sizes 8,6,4,2 -> ((0, 3), (1, 2)): 10 parameters each
    assert (s0.fragment_ids, s1.fragment_ids) == ((0, 3), (1, 2))
    assert [list(f) for f in s1.fragments] == [["w1"], ["w2"]]
    assert s0.checkpoint_dir == spec.checkpoint_dir
    assert s1.checkpoint_dir == spec.checkpoint_dir + "-shard-1" and s1.syncer_shard == 1


def test_a_killed_shard_restarts_alone_and_no_version_goes_back(tmp_path):
    async def scenario():
        single = Syncer(_spec(tmp_path / "single"))     # the unsharded reference
        shards = [Syncer(s) for s in shard_specs(_spec(tmp_path / "sharded"), 2)]
        reg, reg_single = {}, {}
        for name in ("a", "b"):
            first = await shards[0].register(name, 0)
            second = await shards[1].register(name, 0, None, first["session"])
            assert second["session"] == first["session"]     # one session across shards
            assert (first["fragment_ids"], second["fragment_ids"]) == ([0, 3], [1, 2])
            reg[name] = {0: first, 1: second}
            reg_single[name] = await single.register(name, 0)
        owner = {0: 0, 3: 0, 1: 1, 2: 1}

        async def sharded_round(p, version, step):
            s = owner[p]
            return await _round(shards[s], {n: reg[n][s] for n in reg}, p, version, step)

        # Every fragment merges once, fragment 1 twice: shard 1 snapshots at 2 merges, not 3.
        for p, version, step in ((0, 0, 2), (1, 0, 2), (2, 0, 2), (3, 0, 2), (1, 1, 4)):
            replies = await sharded_round(p, version, step)
            ref = await _round(single, reg_single, p, version, step)
            assert [r.status for r in replies] == ["merged", "merged"]
            assert {r.fragment for r in replies} == {p} and replies[0].version == version + 1
            # Sharding moves where a fragment merges, not what it computes: the same Θ[p].
            np.testing.assert_array_equal(replies[0].update.params[f"w{p}"],
                                          ref[0].update.params[f"w{p}"])
        status = combine_status([await s.status() for s in shards])
        assert status["versions"] == [1, 2, 1, 1] and status["merges"] == 5
        assert status["ledger"]["a"]["merged_steps"] == {0: 2, 1: 4, 2: 2, 3: 2}
        held = {1: (2, replies[0].update.params), 2: (1, None)}  # what learner "a" adopted

        # Kill shard 1 (its loop stops, its state is gone); shard 0 keeps merging meanwhile.
        shards[1]._loop_task.cancel()
        dead_epoch = reg["a"][1]["epoch"]
        replies = await sharded_round(0, 1, 4)
        assert replies[0].version == 2
        restarted = Syncer(shard_specs(_spec(tmp_path / "sharded"), 2)[1], epoch=dead_epoch + 1,
                           restore=True)
        assert restarted.restored_from == 2             # its own snapshot: versions (1, 1)
        assert (await restarted.ready())["versions"] == [1, 1]
        # A push of the dead shard's epoch is refused as stale, named by its global fragment.
        stale = await restarted.push(_push("a", 2, -0.1, 4, 1, dead_epoch,
                                           reg["a"][1]["session"], 6))
        assert (stale.status, stale.reason, stale.fragment) == ("rejected", "stale_epoch", 2)
        # The learners register again with the restarted shard only, offering what they adopted
        # (indexed by global id): fragment 1's version 2 is newer than the snapshot and is kept.
        adopted = [(0, None)] * 4
        adopted[1] = (held[1][0], {"w1": held[1][1]["w1"]})
        adopted[2] = (1, {"w2": np.asarray(replies[0].update.params["w0"][:4])})
        for name in ("a", "b"):
            reg[name][1] = await restarted.register(name, 0, adopted, reg[name][0]["session"])
        assert reg["a"][1]["epoch"] == dead_epoch + 1 and reg["a"][1]["versions"] == [2, 1]
        np.testing.assert_array_equal(reg["a"][1]["fragments"][0]["w1"], held[1][1]["w1"])
        shards[1] = restarted
        replies = await sharded_round(1, 2, 6)
        assert replies[0].version == 3 and replies[0].status == "merged"
        status = combine_status([await s.status() for s in shards])
        assert status["versions"] == [2, 3, 1, 1]
        assert [(r["shard"], r["epoch"]) for r in status["shards"]] == [(0, 0), (1, dead_epoch + 1)]
        for s in shards + [single]:
            s._loop_task.cancel()
            if s.store:
                s.store.close()

    asyncio.run(scenario())


def test_the_link_routes_fragments_to_the_shards_the_home_controller_gives_them():
    """The home's link server routes a remote push by fragment with ``build.fragment_layout``; it must
    be the assignment the controller starts the shards with (build.syncer_spec + shard_specs)."""
    from islands.learners.unit import build_training
    from islands.orchestrator import build
    from islands.orchestrator.config import JobConfig
    from islands.syncer.shards import shard_specs

    for fragments, shards in ((4, 2), (5, 3)):
        job = JobConfig.model_validate({"name": "t", "regions": {"a": {"learners": 1}},
                                        "syncer": {"fragments": fragments, "shards": shards}})
        _, template, _, _ = build_training(build.training_spec(job))
        specs = shard_specs(build.syncer_spec(job, template, "/tmp/unused"), shards)
        paths, owned = build.fragment_layout(job)
        assert owned == tuple(spec.fragment_ids for spec in specs)
        assert len(paths) == fragments and sorted(p for ids in owned for p in ids) == list(
            range(fragments))
