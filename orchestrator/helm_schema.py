"""Keeps the Helm chart's ``values.schema.json`` in step with what it embeds: the JobConfig's JSON
schema (``islands config schema``, extra keys forbidden) under ``jobConfig``, so a typo such as
``sycner:`` is refused by ``helm install`` / ``helm template``, not after the slices are up (the
chart writes ``regions`` itself, so the embedded schema has none); and Kubernetes' own schemas
(strict: unknown keys refused) of the objects the chart passes through to its pods
(``securityContext``, ``env``, ``tolerations``, ``affinity``, volumes, network-policy peers, ...),
so ``runAsNonRot``, ``{nmae: regcred}`` or ``efect`` is refused instead of silently dropped by the
API server. Kubernetes' schemas come from the ``kubernetes-validate`` package (a dev dependency:
only regenerating the file needs it).

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
KUBE_VERSION = "1.30.0"
# Where the chart's values hold a Kubernetes object, and which definition types it.
# A path: keys from the schema's root; "[]" types the items of an array.
K8S_VALUES = {
    ("imagePullSecrets", "[]"): "io.k8s.api.core.v1.LocalObjectReference",
    ("env", "[]"): "io.k8s.api.core.v1.EnvVar",
    ("podSecurityContext",): "io.k8s.api.core.v1.PodSecurityContext",
    ("securityContext",): "io.k8s.api.core.v1.SecurityContext",
    ("pod", "affinity"): "io.k8s.api.core.v1.Affinity",
    ("pod", "extraVolumes", "[]"): "io.k8s.api.core.v1.Volume",
    ("pod", "extraVolumeMounts", "[]"): "io.k8s.api.core.v1.VolumeMount",
    ("head", "tolerations", "[]"): "io.k8s.api.core.v1.Toleration",
    ("regions", "*", "tolerations", "[]"): "io.k8s.api.core.v1.Toleration",
    ("regions", "*", "affinity"): "io.k8s.api.core.v1.Affinity",
    ("networkPolicy", "extraIngress", "[]"): "io.k8s.api.networking.v1.NetworkPolicyIngressRule",
    ("dashboard", "ingress", "tls", "[]"): "io.k8s.api.networking.v1.IngressTLS",
    ("link", "server", "allowFrom", "[]"): "io.k8s.api.networking.v1.NetworkPolicyPeer",
    ("console", "allowFrom", "[]"): "io.k8s.api.networking.v1.NetworkPolicyPeer",
    ("autoscaler", "options", "securityContext"): "io.k8s.api.core.v1.SecurityContext",
    ("autoscaler", "options", "env", "[]"): "io.k8s.api.core.v1.EnvVar",
    ("autoscaler", "options", "volumeMounts", "[]"): "io.k8s.api.core.v1.VolumeMount",
}
K8S_PREFIX = "io.k8s."
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


def _strip(node):
    """Without descriptions (Kubernetes' are long; the chart's README documents its values) and
    ``x-kubernetes-*`` annotations, which Helm's validator ignores."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items()
                if k != "description" and not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def kubernetes_definitions(roots) -> dict:
    """The strict schemas of ``roots`` and every definition they refer to."""
    import kubernetes_validate

    path = os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema",
                        f"v{KUBE_VERSION}-local-strict", "_definitions.json")
    with open(path) as f:
        every = json.load(f)["$defs"]
    wanted, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted[name] = _refs(_strip(every[name]),
                             lambda ref: ref.replace("#/$defs/", "#/definitions/"))
        text = json.dumps(wanted[name])
        todo += [ref.split('"')[0] for ref in text.split('"$ref": "#/definitions/')[1:]]
    return dict(sorted(wanted.items()))


def _type_value(schema: dict, path: tuple, definition: str) -> None:
    """Points the value at ``path`` (``*``: any key of a map, ``[]``: an array's items) at a
    Kubernetes definition, keeping its description."""
    node = schema
    for i, key in enumerate(path[:-1]):
        if key == "*":
            node = node["additionalProperties"]
        elif key == "[]":
            node = node["items"]
        else:   # a key the chart's schema leaves open (autoscaler.options: KubeRay's object)
            node = node.setdefault("properties", {}).setdefault(
                key, {"type": "array"} if path[i + 1] == "[]" else {"type": "object"})
    last = path[-1]
    ref = {"$ref": f"#/definitions/{definition}"}
    if last == "[]":
        node["items"] = ref
    else:
        props = node.setdefault("properties", {})   # (autoscaler.options: a KubeRay object)
        old = props.get(last, {})
        props[last] = {**ref, **({"description": old["description"]}
                                 if "description" in old else {})}


def chart_schema(current: dict) -> dict:
    """``current`` with its embedded parts regenerated (everything else kept as written)."""
    out = copy.deepcopy(current)
    kept = {k: v for k, v in (out.get("definitions") or {}).items()
            if not k.startswith((PREFIX, K8S_PREFIX))}
    out["definitions"] = {**kept, **kubernetes_definitions(set(K8S_VALUES.values())),
                          **jobconfig_definitions()}
    out["properties"]["jobConfig"] = {"$ref": f"#/definitions/{PREFIX}JobConfig"}
    for path, definition in K8S_VALUES.items():
        _type_value(out, path, definition)
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
