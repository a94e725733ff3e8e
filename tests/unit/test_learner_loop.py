"""What the learner takes off its step's path: the next batch made while a step runs, and a push
whose codes are collected after the next step started."""

import jax
import jax.numpy as jnp
import numpy as np

from islands.learners.core import LearnerCore
from islands.learners.loop import LearnerLoop
from islands.syncer import codec as codec_lib
from islands.syncer import fragments


def make_loop(batches):
    params = {"a": jnp.ones((4, 8), jnp.float32), "b": jnp.zeros(5, jnp.float32)}
    codec = codec_lib.make_codec("int4", block_size=8)
    core = LearnerCore("x:0", params, None, fragments.partition(params, 2), [0, 0],
                       codec_lib.error_feedback(codec), codec_lib.tree_wire_bytes,
                       lambda codes: codec_lib.decode_tree(codec, codes), overlap_steps=0)

    def train_step(p, state, batch):
        return jax.tree_util.tree_map(lambda v: v + batch, p), state, jnp.float32(batch)

    def batch_at(step):
        batches.append(step)
        return float(step) * 0.1

    return core, LearnerLoop(core, train_step, batch_at, tokens_per_batch=4, num_fragments=2,
                             sync_every_steps=2)


def test_a_prefetched_batch_is_used_once_and_only_for_its_step():
    made = []
    core, loop = make_loop(made)
    loop.prefetch(0)
    assert loop.batch() == 0.0 and made == [0]   # the prefetched one: not made again
    loop.train(loop.batch())
    loop.prefetch(core.step + 1)                 # while "the step runs"
    loop.record(0.01)
    assert loop.batch() == 0.1 and made == [0, 1]
    loop.prefetch(5)                             # made for another step: not used
    assert loop.batch() == 0.1 and made == [0, 1, 5, 1]


def test_a_dispatched_push_comes_to_the_host_unchanged():
    core, loop = make_loop([])
    for _ in range(2):
        loop.train(loop.batch())
        loop.record(0.01)
    plans = loop.pushes(epoch=0)
    assert plans
    for plan in plans:
        host = plan.on_host()
        assert isinstance(host.relative_error, float)
        assert host.relative_error == float(plan.relative_error)
        assert host.wire_bytes == plan.wire_bytes == codec_lib.tree_wire_bytes(host.push.codes)
        for path, code in host.push.codes.items():
            assert isinstance(code.payload, np.ndarray)
            np.testing.assert_array_equal(code.payload, np.asarray(plan.push.codes[path].payload))
            np.testing.assert_array_equal(code.scales, np.asarray(plan.push.codes[path].scales))
        assert host.push.step == plan.push.step == 2 and host.push.c_steps == 2
