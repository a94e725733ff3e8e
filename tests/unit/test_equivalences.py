"""docs/architecture.md#the-algorithm equivalences: the in-process driver against independently written references.

- K = M, infinite grace, equal speeds  ==  synchronous streaming DiLoCo (with overlap τ)
- P = 1                               ==  DiLoCo
- H = 1, outer sgd(1.0), α = 0         ==  parameter averaging
Each reference below is written from the textbook definition, not from the core's functions.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.orchestrator import inprocess
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerSettings

M = 3
from tiny_task import TOKENS, batch_for  # noqa: E402  (the shared tiny task)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5,
            "bias": jnp.zeros(2), "scale": jnp.ones(8)}


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"]) * params["scale"][None, :]
    return jnp.mean((h @ params["w2"] + params["bias"][None, :] - y) ** 2)


INNER = optax.adam(3e-2)


@jax.jit
def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def run_driver(P, H, tau, steps, outer_opt, K=M, alpha=0.0):
    params = init_params()
    plan = fragments.partition(params, P)
    settings = SyncerSettings(min_learners=K, grace_gamma=0.5, grace_cap_s=math.inf,
                              overlap_steps=tau, merge_rule=merge.MergeRule.MEAN,
                              outlier_norm_factor=None, history_versions=8)
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=plan, settings=settings,
        outer_optimizer=outer_opt, error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda codes: codec_lib.decode_tree(codec, codes),
        wire_bytes=codec_lib.tree_wire_bytes, learner_ids=[f"r:{i}" for i in range(M)],
        merge_alpha=alpha, carry_overlap=False)  # the references blend (α = 0: overwrite)
    record = inprocess.run_inprocess(
        learners=learners, syncer=syncer, train_step=train_step, batch_for=batch_for,
        tokens_per_batch=TOKENS, fleet=inprocess.Fleet(speed_factors=[1.0] * M),
        num_fragments=P, sync_every_steps=H, steps=steps, assemble=inprocess.assemble_like(params))
    return record, plan


def flat(tree):
    return fragments.flatten(jax.tree_util.tree_map(np.asarray, tree))


def assert_trees_close(a, b, atol=1e-6, rtol=1e-5):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(fa[k], fb[k], atol=atol, rtol=rtol, err_msg=k)


def reference_streaming_diloco(P, H, tau, steps, outer_opt):
    """Synchronous streaming DiLoCo, straight from its definition.

    After inner step t, every fragment p with t ≡ (p·H)//P (mod H) is synced: the outer gradient is
    the mean over learners of Θ_p − θ_m,p, the outer optimizer steps Θ_p, and every learner
    overwrites its copy of p with the new Θ_p after step t + τ.
    """
    params = init_params()
    plan = fragments.partition(params, P)
    offsets = [(p * H) // P for p in range(P)]
    global_flat = {k: np.asarray(v) for k, v in flat(params).items()}
    outer_states = {p: outer_opt.init({k: global_flat[k] for k in plan.fragments[p]})
                    for p in range(P)}
    local = [params for _ in range(M)]
    opt_states = [INNER.init(params) for _ in range(M)]
    pending = []  # (adopt after step, fragment, values)
    for t in range(1, steps + 1):
        for m in range(M):
            local[m], opt_states[m], _ = train_step(local[m], opt_states[m], batch_for(m, t - 1))
        for p in range(P):
            if t % H != offsets[p] % H:
                continue
            keys = plan.fragments[p]
            theta = {k: global_flat[k] for k in keys}
            grad = {k: np.mean([theta[k] - np.asarray(flat(local[m])[k]) for m in range(M)], axis=0)
                    for k in keys}
            updates, outer_states[p] = outer_opt.update(grad, outer_states[p], theta)
            new = optax.apply_updates(theta, updates)
            global_flat.update({k: np.asarray(v) for k, v in new.items()})
            pending.append((t + tau, p, {k: np.asarray(v) for k, v in new.items()}))
        for item in [x for x in pending if x[0] <= t]:
            pending.remove(item)
            _, p, values = item
            local = [fragments.insert(local[m], plan, p, values) for m in range(M)]
    return global_flat, local


@pytest.mark.parametrize("tau", [0, 2])
def test_k_equals_m_is_synchronous_streaming_diloco(tau):
    P, H, steps = 2, 4, 12
    opt = outer.build("nesterov", lr=0.7, momentum=0.9)
    record, _ = run_driver(P, H, tau, steps, opt)
    ref_global, ref_local = reference_streaming_diloco(P, H, tau, steps, opt)
    assert len(record.merges) == 2 * 3  # every fragment merged once per round, 3 rounds
    assert all(len(m.learners) == M for m in record.merges)
    assert_trees_close(record.global_params, inprocess.assemble_like(init_params())(ref_global))
    for m in range(M):
        assert_trees_close(record.learner_params[m], ref_local[m])


def test_p_equals_one_is_diloco():
    """DiLoCo: every H steps, Θ ← outer(Θ, mean_m(Θ − θ_m)) and every learner restarts from Θ."""
    H, steps = 5, 15
    opt = outer.build("nesterov", lr=0.7, momentum=0.9)
    record, _ = run_driver(1, H, 0, steps, opt)
    theta = init_params()
    state = opt.init(theta)
    local = [theta] * M
    opt_states = [INNER.init(theta) for _ in range(M)]
    for t in range(1, steps + 1):
        for m in range(M):
            local[m], opt_states[m], _ = train_step(local[m], opt_states[m], batch_for(m, t - 1))
        if t % H == 0:
            grad = jax.tree_util.tree_map(lambda g, *ls: sum(g - l for l in ls) / M, theta, *local)
            updates, state = opt.update(grad, state, theta)
            theta = optax.apply_updates(theta, updates)
            local = [theta] * M
    assert_trees_close(record.global_params, theta)
    for m in range(M):
        assert_trees_close(record.learner_params[m], theta)


def test_h_one_sgd_one_is_parameter_averaging():
    """After every inner step all learners take the plain average of their parameters."""
    steps = 6
    record, _ = run_driver(1, 1, 0, steps, outer.build("sgd", lr=1.0, momentum=0.0))
    local = [init_params()] * M
    opt_states = [INNER.init(local[0]) for _ in range(M)]
    for t in range(1, steps + 1):
        for m in range(M):
            local[m], opt_states[m], _ = train_step(local[m], opt_states[m], batch_for(m, t - 1))
        avg = jax.tree_util.tree_map(lambda *ls: sum(ls) / M, *local)
        local = [avg] * M
    assert_trees_close(record.global_params, local[0])
    assert len(record.merges) == steps


def test_driver_is_deterministic_and_never_waits_with_k1():
    opt = outer.build("nesterov")
    a, _ = run_driver(2, 4, 2, 8, opt, K=1)
    b, _ = run_driver(2, 4, 2, 8, opt, K=1)
    assert_trees_close(a.global_params, b.global_params, atol=0, rtol=0)
    assert a.steps == [8] * M
