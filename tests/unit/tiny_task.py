"""The tiny regression task the in-process driver's tests train on: 4 inputs, 2 outputs, a
learner-dependent target (so learners' data differ), 16 examples a batch, the same batch for the
same (learner, index) in every test."""

import numpy as np

TOKENS = 16   # examples per batch


def batch_for(learner, index):
    rng = np.random.default_rng(1000 * learner + index)
    x = rng.normal(size=(TOKENS, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]) + 0.1 * learner, x[:, 1] * x[:, 2]], axis=1).astype(np.float32)
    return x, y
