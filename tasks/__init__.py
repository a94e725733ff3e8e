"""Built-in tasks (``task.path`` values): ``islands.tasks.bytelm:task`` (the default byte LM in plain
JAX) and ``islands.tasks.flax_lm:task`` (a Flax NNX decoder fed by a Grain pipeline)."""
