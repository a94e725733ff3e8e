"""Keeps the Helm chart's ``values.schema.json`` in step with the JobConfig it embeds: the
JobConfig's JSON schema (``islands config schema``, extra keys forbidden) under ``jobConfig``, so a
typo such as ``sycner:`` is refused by ``helm install`` / ``helm template``, not after the slices
are up. The chart writes ``regions`` itself, so the embedded schema has none.

``python -m islands.orchestrator.helm_schema`` rewrites ``helm/islands/values.schema.json``;
``tests/unit/test_helm_chart.py`` fails when the file differs from what this writes. Cross-field
rules the JSON schema cannot say (a quorum above the learners, ...) stay in the JobConfig's own
validation, which ``islands run`` applies when the job starts.
"""

from __future__ import annotations

import copy
import json
import os
import sys

PREFIX = "islands.jobconfig."
CHART_SCHEMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helm",
                            "islands", "values.schema.json")


def _refs(node, rewrite):
    """``node`` with every ``$ref`` passed through ``rewrite``."""
    if isinstance(node, dict):
        return {k: (rewrite(v) if k == "$ref" else _refs(v, rewrite)) for k, v in node.items()}
    if isinstance(node, list):
        return [_refs(v, rewrite) for v in node]
    return node


def jobconfig_definitions() -> dict:
    """``definitions`` entries: the JobConfig without ``regions`` and its sub-models, their
    references rewritten to point into the chart's schema document."""
    from .config import JobConfig

    schema = JobConfig.model_json_schema()
    defs = schema.pop("$defs", {})
    schema["properties"].pop("regions", None)
    schema["required"] = [k for k in schema.get("required", []) if k != "regions"]
    if not schema["required"]:
        schema.pop("required")
    schema["additionalProperties"] = False
    schema["description"] = ("The islands JobConfig (`islands config schema`) without `regions`, "
                             "which the chart writes from the top-level `regions`.")
    out = {PREFIX + "JobConfig": schema, **{PREFIX + name: d for name, d in defs.items()}}
    return _refs(out, lambda ref: "#/definitions/" + PREFIX + ref[len("#/$defs/"):]
                 if ref.startswith("#/$defs/") else ref)


def chart_schema(current: dict) -> dict:
    """``current`` with the embedded JobConfig regenerated (everything else kept as written)."""
    out = copy.deepcopy(current)
    kept = {k: v for k, v in (out.get("definitions") or {}).items() if not k.startswith(PREFIX)}
    out["definitions"] = {**kept, **jobconfig_definitions()}
    out["properties"]["jobConfig"] = {"$ref": f"#/definitions/{PREFIX}JobConfig"}
    return out


def render(path: str = CHART_SCHEMA) -> str:
    with open(path) as f:
        return json.dumps(chart_schema(json.load(f)), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    text = render()
    with open(CHART_SCHEMA, "w") as f:
        f.write(text)
    print(f"wrote {CHART_SCHEMA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
