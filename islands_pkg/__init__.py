"""Islands: an elastic Decoupled DiLoCo service on Ray (arXiv 2604.21428).

The top-level folders `learners/`, `syncer/` and `orchestrator/` install as
`islands.learners`, `islands.syncer` and `islands.orchestrator` (see docs/architecture.md#code-layout).
"""

__version__ = "0.1.0"
