"""The worked examples in the core modules' docstrings are tests too."""

import doctest
import importlib

import pytest

MODULES = ["islands.syncer.fragments", "islands.syncer.merge", "islands.syncer.quorum",
           "islands.learners.core", "islands.learners.mesh", "islands.orchestrator.health",
           "islands.orchestrator.metrics", "islands.orchestrator.chaos",
           "islands.orchestrator.recovery", "islands.orchestrator.accelerators",
           "islands.orchestrator.fleet", "islands.orchestrator.region_agent", "islands.link.client",
            "islands.syncer.state", "islands.link.premerge", "islands.syncer.core",
           "islands.faults", "islands.learners.devices", "islands.orchestrator.runtime",
           "islands.orchestrator.cli", "islands.orchestrator.seam", "islands.syncer.timing",
           "islands.orchestrator.groups_api", "islands.syncer.status",
           "islands.orchestrator.logs", "islands.orchestrator.owner",
           "islands.orchestrator.commands", "islands.orchestrator.serving",
           "islands.orchestrator.controller_records"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
