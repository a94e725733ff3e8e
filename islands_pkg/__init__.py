"""Islands: an elastic Decoupled DiLoCo service on Ray (arXiv 2604.21428).

The top-level folders `learners/`, `syncer/` and `orchestrator/` install as
`islands.learners`, `islands.syncer` and `islands.orchestrator` (see docs/architecture.md#code-layout).
"""

__version__ = "0.1.0"

# The one default for what a learner does with the τ steps between a push and the adoption of
# its merge (``learner.overlap``): "carry" keeps them in the next drift, "blend" (α = 0:
# overwrite) drops them. The config, LearnerCore, TrainingSpec, the in-process drivers and the
# benchmark helpers all read it from here (docs/tuning.md says why carry).
DEFAULT_OVERLAP = "carry"
CARRY_OVERLAP = DEFAULT_OVERLAP == "carry"
