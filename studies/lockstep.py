"""Regional pre-merge against the flat link with the timing taken out: one region's L learners
stepped in lockstep, so that every round holds every learner whether the region pre-merges or
not, over real parts — the home's link server (gRPC, chunked streams) and the region's
``LinkClient`` (its ``PreMerger`` when pre-merge is on, its relay counting every byte on the
socket), a real ``SyncerCore`` at home (weighted mean, K = L) and real ``LearnerCore``s training
the tiny byte LM with JAX. What is left between a flat and a pre-merged run on one seed is what
pre-merge itself does: the region's mean re-encoded (with its own error feedback) instead of L
codes crossing, and one shared update coming back instead of L.

Used by ``tests/unit/test_premerge_lockstep.py`` and ``benchmarks/premerge_lockstep.py``;
``CoreHome`` (a SyncerCore as the link server's home, with an optional round timeout) also by
``benchmarks/premerge.py`` and ``benchmarks/wan.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import jax
import numpy as np

# Steps, sync period H, overlap τ, batch per learner (one fragment: every push is due together).
STEPS, H, TAU, BATCH = 48, 8, 2, 8


class CoreHome:
    """The home backend behind a link server: a real ``SyncerCore`` behind a lock. A push's call
    returns when its round merged: when every live learner is in, or (with ``round_timeout_s``)
    that long after the round opened, as the Syncer actor's grace window would; None waits for
    every live learner (lockstep: all of them push each round)."""

    def __init__(self, core, round_timeout_s: Optional[float] = None):
        self.core = core
        self.round_timeout_s = round_timeout_s
        self.cond = threading.Condition()
        self.results: dict[int, tuple] = {}   # fragment -> (updates by learner, version)
        self.rounds = [0] * len(core.slots)

    def epoch(self):
        return 0

    def register(self, learner, incarnation, adopted, session="", syncer_shard=0):
        with self.cond:
            epoch, frags = self.core.register(learner, incarnation)
            self.cond.notify_all()
        return {"epoch": epoch, "fragments": [f for f, _ in frags],
                "versions": [v for _, v in frags], "session": ""}

    def forget(self, learner, incarnation, reason):
        with self.cond:
            dropped = self.core.forget(learner)
            self.cond.notify_all()
        return len(dropped)

    def push(self, push):
        from islands.syncer.actor import Reply

        p = push.fragment
        with self.cond:
            verdict = self.core.accept_push(push, time.monotonic())
            if not verdict.ok:
                params, version = self.core.fragment(p)
                return Reply("rejected", p, 0, params, version, verdict.reason.value)
            mine = self.rounds[p]
            opened = self.core.slots[p].round_opened_at_s
            deadline = None if self.round_timeout_s is None else opened + self.round_timeout_s
            while self.rounds[p] == mine:
                slot = self.core.slots[p]
                live = frozenset(self.core.learners)
                if slot.round and (live <= set(slot.round)
                                   or (deadline is not None and time.monotonic() >= deadline)):
                    result = self.core.merge(p, live_count=len(live))
                    self.rounds[p] += 1
                    # Per learner: the full fragment or its encoded update (downlink codec).
                    self.results[p] = (self.core.updates(result), result.version)
                    self.cond.notify_all()
                    break
                if not slot.round:   # the round was dropped (a forget): not in a merge
                    return Reply("dropped", p, 0)
                wait_s = 60.0 if deadline is None else max(0.01, deadline - time.monotonic())
                if not self.cond.wait(wait_s) and deadline is None:
                    raise RuntimeError("a lockstep round never filled")
            updates, version = self.results[p]
        # A pre-merged push's members share one update (syncer/core.py: updates).
        name = push.members[0].learner if push.members else push.learner
        return Reply("merged", p, 0, None, version, update=updates[name])


def train_region(learners: int, premerge: bool, seed: int = 0, codec_kind: str = "nf2",
                 downlink_kind: Optional[str] = "nf2", steps: int = STEPS,
                 uneven_tokens: bool = False, init_noise: float = 0.0) -> dict:
    """Trains L learners of region "far" over the link for ``steps`` steps, flat or pre-merged; the
    pushes in ``codec_kind`` (block 64), the replies in ``downlink_kind`` (block 256; None: fp32
    fragments). ``uneven_tokens``: learner i counts (i + 1)× the tokens per step, so the merge
    weights (c_tokens² / c_steps) differ. ``init_noise``: adds that times N(0, 1) (a fixed key)
    to the initial parameters, for the size of a run's own sensitivity.

    Returns {up, down: WAN bytes per merged token after the registrations; loss, initial_loss:
    eval loss of Θ at the end and the start; merges; wan_pushes; params: Θ (flat dict);
    premerge: the region's PreMerger counts, None when flat}."""
    from islands.learners import data, inner, model
    from islands.learners.core import LearnerCore
    from islands.learners.loop import LearnerLoop
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import ServerSettings, serve
    from islands.orchestrator.config import JobConfig
    from islands.syncer import codec as C
    from islands.syncer import downlink as downlink_lib
    from islands.syncer import fragments, outer
    from islands.syncer.core import SyncerCore, SyncerSettings
    from islands.syncer.merge import MergeRule

    cfg = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    params = model.init_params(cfg, jax.random.PRNGKey(seed))
    if init_noise:
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(99), len(leaves))
        params = jax.tree_util.tree_unflatten(tree, [
            leaf + init_noise * jax.random.normal(k, leaf.shape, leaf.dtype)
            for leaf, k in zip(leaves, keys)])
    plan = fragments.partition(params, 1)
    corpus = data.load_stdlib_corpus(max_bytes=200_000)
    samplers = [data.ShardSampler(corpus.train, BATCH, cfg.seq_len, i, learners)
                for i in range(learners)]
    opt = inner.inner_optimizer(lr=3e-3, warmup_steps=8, total_steps=steps)
    train_step = inner.make_train_step(cfg, opt)
    codec = C.make_codec(codec_kind, block_size=64)
    core = SyncerCore([fragments.extract(params, plan, 0)],
                      SyncerSettings(min_learners=learners, overlap_steps=TAU,
                                     merge_rule=MergeRule.MEAN), outer.build(),
                      lambda c: C.decode_tree(codec, c), is_embedding=model.is_embedding_path,
                      downlink=downlink_lib.DownlinkSettings(
                          C.make_codec(downlink_kind, block_size=256) if downlink_kind else None))
    home = CoreHome(core)
    config = JobConfig.model_validate({
        "regions": {"far": {"learners": learners, "remote": True}},
        "syncer": {"fragments": 1, "sync_every_steps": H, "overlap_steps": TAU,
                   "merge_rule": "mean"},
        # the region's re-encode
        "compression": ({"type": codec_kind} if codec_kind == "none"
                        else {"type": codec_kind, "block_size": 64}),
        "link": {"port": 0, "premerge": premerge, "premerge_window_s": 60.0}})
    server, port = serve(home, config.model_dump_json(),
                         ServerSettings(port=0, token="lockstep"))
    client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="lockstep",
                                       tls=False, report_every_s=3600))
    try:
        client.hello()
        loops = []
        for i in range(learners):
            name = f"far:{i}"
            reg = client.register(name, 0)
            lc = LearnerCore(name, params, opt.init(params), plan, reg["versions"],
                             C.error_feedback(codec), C.tree_wire_bytes,
                             lambda c: C.decode_tree(codec, c), overlap_steps=TAU,
                             merge_alpha=0.0)
            loops.append(LearnerLoop(lc, train_step, samplers[i].batch_at,
                                     BATCH * cfg.seq_len * (i + 1 if uneven_tokens else 1), 1, H))
        start = client.relay.counters()   # the registrations' full fragments are not counted
        for _ in range(steps):
            due = []
            for loop in loops:
                loop.adopt()
                float(loop.train(loop.batch()))
                loop.record(0.01)
                due += [(loop.core, plan_.on_host().push) for plan_ in loop.pushes(0)]
            if len(due) not in (0, learners):
                raise RuntimeError(f"the learners fell out of step: {len(due)} pushes due")
            replies: dict = {}
            threads = [threading.Thread(target=lambda lc, push: replies.__setitem__(
                lc.learner, (push, client.push(push))), args=item) for item in due]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for lc, _ in due:
                push, reply = replies[lc.learner]
                if reply.status != "merged":
                    raise RuntimeError(f"a lockstep push was not merged: {reply}")
                lc.offer_reply(push.fragment, reply.update if reply.update is not None
                               else reply.params, reply.version)
        end = client.relay.counters()
        merged = client.counts["merged_tokens"]
        evaluate = inner.make_eval_fn(cfg)
        eval_set = data.eval_batches(corpus.eval, BATCH, cfg.seq_len, 4)
        loss = float(evaluate(fragments.assembler(params)(core.params_flat()), eval_set))
        return {"up": (end["up"] - start["up"]) / merged,
                "down": (end["down"] - start["down"]) / merged, "loss": loss,
                "initial_loss": float(evaluate(params, eval_set)),
                "merges": core.versions[0], "wan_pushes": client.counts["wan_pushes"],
                "params": {k: np.asarray(v) for k, v in core.params_flat().items()},
                "premerge": dict(client.premerger.counts) if client.premerger else None}
    finally:
        client.close()
        server.stop(0)
