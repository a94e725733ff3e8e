"""helm/islands: rendered with Helm's own engine (helm-python-sdk, no cluster), linted, and the
objects checked against KubeRay's CRD schemas, Kubernetes' schemas and islands' own JobConfig."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex

import jsonschema
import pytest
import yaml

hp = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from islands.orchestrator.config import parse  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(REPO, "helm", "islands")
# Every values file under deploy/helm/, by its path there: single files (values-*.yaml) and the
# releases of a deployment of several clusters, one folder each (gke-4-regions/home.yaml, ...).
EXAMPLE_DIR = os.path.join(REPO, "deploy", "helm")
EXAMPLES = sorted(glob.glob(os.path.join(EXAMPLE_DIR, "**", "*.yaml"), recursive=True))
CRD_DIR = os.environ.get("ISLANDS_KUBERAY_CRDS") or os.path.join(os.path.dirname(REPO), "shared",
                                                                  "kuberay")
KUBE_VERSION = "1.30.0"
RAY_KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
# Objects of CRDs kubernetes-validate has no schema for; checked field by field below.
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor"}
CASES = ["default"] + [os.path.relpath(p, EXAMPLE_DIR) for p in EXAMPLES]
# Region releases (`link.region.enabled`) render no JobConfig: their agent fetches the home's.
REGION_CASES = [c for c in CASES if c != "default" and yaml.safe_load(
    open(os.path.join(EXAMPLE_DIR, c))).get("link", {}).get("region", {}).get("enabled")]
HOME_CASES = [c for c in CASES if c not in REGION_CASES]


@functools.lru_cache(maxsize=None)
def chart():
    return hp.Chart.load(CHART)


def example_values(case: str) -> dict:
    if case == "default":
        return {}
    with open(os.path.join(EXAMPLE_DIR, case)) as f:
        return yaml.safe_load(f)


# The chart names no region by default: a test that names none gets this CPU region.
LOCAL = {"learners": 2, "maxLearners": 3, "accelerator": {"type": "cpu"},
         "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                       "limits": {"cpu": "1", "memory": "2Gi"}}}


def with_regions(values: dict | None) -> dict:
    values = dict(values or {})
    values.setdefault("regions", {"local": LOCAL})
    return values


def render(values: dict | None = None) -> dict[str, str]:
    return chart().render(with_regions(values), name="demo", namespace="train")


def objects(values: dict | None = None) -> list[dict]:
    out = []
    for path, text in render(values).items():
        if path.endswith(".yaml"):
            out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def only(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def cluster_spec(objs: list[dict]) -> dict:
    ray = [o for o in objs if o["kind"] in RAY_KINDS]
    assert len(ray) == 1, [o["kind"] for o in ray]
    spec = ray[0]["spec"]
    return spec["rayClusterSpec"] if ray[0]["kind"] == "RayJob" else spec


def containers(objs: list[dict]):
    spec = cluster_spec(objs)
    for group in [spec["headGroupSpec"]] + spec.get("workerGroupSpecs", []):
        for container in group["template"]["spec"]["containers"]:
            yield group, container


def region_resources(group: dict) -> dict:
    """``rayStartParams.resources`` as KubeRay passes it to ``ray start --resources``: a JSON
    object inside double quotes."""
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), raw
    return json.loads(json.loads(raw))


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str):
    path = os.path.join(CRD_DIR, RAY_KINDS[kind])
    if not os.path.isfile(path):
        pytest.skip(f"KubeRay v1.7.0 CRDs not found at {CRD_DIR} (set ISLANDS_KUBERAY_CRDS to a "
                    f"directory holding {', '.join(RAY_KINDS.values())})")
    with open(path) as f:   # 1-2 MB each: libyaml's loader reads them ~10x faster
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = version["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


def crd_errors(obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(obj["kind"]).iter_errors(obj)]


# -- every values file: renders, lints, validates --------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_lint_passes(case):
    report = hp.lint(CHART, example_values(case) or None, strict=True,
                     kube_version=f"v{KUBE_VERSION}")
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and errors == [], report


@pytest.mark.parametrize("case, extra", [(c, {}) for c in CASES] + [
    ("default", {"mode": "cluster"}), ("values-region.yaml", {"mode": "cluster"})])
def test_ray_objects_match_kuberay_crds(case, extra):
    objs = objects({**example_values(case), **extra})
    ray = [o for o in objs if o["kind"] in RAY_KINDS]
    assert len(ray) == 1
    assert crd_errors(ray[0]) == []


def test_crd_validation_can_fail():
    objs = objects()
    job = only(objs, "RayJob")
    del job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"]
    job["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    errors = crd_errors(job)
    assert any("'maxReplicas' is a required property" in e for e in errors), errors
    assert any("authOptions/mode" in e for e in errors), errors


@pytest.mark.parametrize("case", CASES)
def test_core_objects_match_kubernetes_schemas(case):
    core = [o for o in objects(example_values(case)) if o["kind"] not in set(RAY_KINDS) | MONITOR_KINDS]
    kinds = {o["kind"] for o in core}
    if case in REGION_CASES:   # no JobConfig, no controller /metrics: the home has both
        assert {"NetworkPolicy"} <= kinds and not kinds & {"ConfigMap", "Service"}, kinds
    else:
        assert {"ConfigMap", "Service", "NetworkPolicy"} <= kinds, kinds
    assert "Secret" not in kinds   # the Ray token is KubeRay's; the link's are the user's
    for obj in core:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        broken = dict(only(core, "NetworkPolicy"), spec={"podSelector": {}, "ingres": []})
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", HOME_CASES)
def test_rendered_job_config_passes_islands_validation(case):
    values = with_regions(example_values(case))
    objs = objects(values)
    text = next(o for o in objs if o["kind"] == "ConfigMap"
                and o["metadata"]["name"] == "demo-islands-job")["data"]["job.yaml"]
    config = parse(yaml.safe_load(text))
    merged = chart().merge_values(values)
    enabled = {n: r for n, r in merged["regions"].items() if not r.get("disabled")}
    assert sorted(config.regions) == sorted(enabled)
    for name, region in enabled.items():
        assert config.regions[name].learners == region["learners"]
        assert config.regions[name].max_learners == (region.get("maxLearners") or region["learners"])
        assert config.regions[name].remote is bool(region.get("remote"))
    # One worker group per region of this cluster; none for a remote one.
    groups = [g["groupName"] for g in cluster_spec(objs)["workerGroupSpecs"]]
    assert sorted(groups) == sorted(n for n, r in enabled.items() if not r.get("remote"))
    assert (config.link.port is not None) == merged["link"]["server"]["enabled"]
    assert config.metrics.host == "0.0.0.0" and config.metrics.port == merged["metrics"]["port"]
    # The entrypoint reads the file the head mounts.
    job = only(objs, "RayJob")
    assert job["spec"]["entrypoint"].startswith("islands run /etc/islands/job.yaml")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    volume = next(v for v in head["volumes"] if v["name"] == mounts["/etc/islands"])
    assert volume["configMap"]["name"].endswith("-job")


# -- one worker group per region -------------------------------------------------------------------
GKE_4 = {"home.yaml": "us-east5", "us-central1.yaml": "us-central1",
         "europe-west4.yaml": "europe-west4", "asia-northeast1.yaml": "asia-northeast1"}


def test_four_regions_are_four_releases_with_tpu_selectors_and_limits():
    """The four-region GKE example is one release per cluster: the home's worker group is its own
    region, and each other region is the one worker group of its own release."""
    # v5p 2x2x1 is 4 chips on one host; v6e 2x4 is 8 chips on one host.
    expected = {"us-east5": ("tpu-v5p-slice", "2x2x1", 4), "us-central1": ("tpu-v5p-slice", "2x2x1", 4),
                "europe-west4": ("tpu-v6e-slice", "2x4", 8), "asia-northeast1": ("tpu-v6e-slice", "2x4", 8)}
    for case, name in GKE_4.items():
        (group,) = cluster_spec(objects(example_values(f"gke-4-regions/{case}")))["workerGroupSpecs"]
        assert group["groupName"] == name, case
        tpu, topology, chips = expected[name]
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": tpu,
                                       "cloud.google.com/gke-tpu-topology": topology}
        resources = pod["containers"][0]["resources"]
        assert resources["limits"]["google.com/tpu"] == chips
        assert resources["requests"]["google.com/tpu"] == chips
        assert region_resources(group) == {f"region:{name}": 1}
        assert (group["replicas"], group["maxReplicas"], group["numOfHosts"]) == (2, 4, 1)
        assert pod["containers"][0]["name"] == "ray-worker"
    assert sorted(f"gke-4-regions/{c}" for c in GKE_4) == sorted(
        c for c in CASES if c.startswith("gke-4-regions/"))
    assert sorted(c for c in REGION_CASES if c.startswith("gke-4-regions/")) == sorted(
        f"gke-4-regions/{c}" for c in GKE_4 if c != "home.yaml")


def test_gpu_and_cpu_regions():
    spec = cluster_spec(objects(example_values("values-gpu.yaml")))
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and "google.com/tpu" not in limits
        assert region_resources(group) == {f"region:{group['groupName']}": 1}
    assert spec["enableInTreeAutoscaling"] is True
    spec = cluster_spec(objects(example_values("values-kind.yaml")))
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["eu-west", "us-east"]
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert set(limits) == {"cpu", "memory"}


def tpu_region(tpu_type="tpu-v5p-slice", topology="2x4x4", **extra):
    return {"regions": {"big": {
        "learners": 2, "accelerator": {"type": "tpu", "tpuType": tpu_type, "topology": topology},
        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}, **extra}}}


def test_multi_host_slices_split_chips_per_host():
    values = tpu_region(hostsPerLearner=8)
    objs = objects(values)
    (group,) = cluster_spec(objs)["workerGroupSpecs"]
    # v5p 2x4x4 is 32 chips on 8 hosts of 4: replicas are learners, numOfHosts a learner's pods.
    assert (group["replicas"], group["numOfHosts"]) == (2, 8)
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    # The JobConfig says the same, and the job runs each learner as an 8-host unit.
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "demo-islands-job")
    raw = yaml.safe_load(cm["data"]["job.yaml"])
    assert raw["regions"]["big"] == {"learners": 2, "max_learners": 2, "accelerator": "tpu",
                                     "tpu_type": "v5p", "topology": "2x4x4"}
    assert parse(raw).regions["big"].devices().hosts == 8


@pytest.mark.parametrize("values, message", [
    # chips per host that do not match the TPU type (v5p hosts have 4 chips, not 8)
    (tpu_region(hostsPerLearner=4), "regions.big.hostsPerLearner: tpu-v5p-slice 2x4x4 is 32 chips "
                                    "on 8 host(s) of 4 chips; set hostsPerLearner: 8 (got 4)"),
    # a multi-host topology without its hosts
    (tpu_region("tpu-v6e-slice", "4x4"), "regions.big.hostsPerLearner: tpu-v6e-slice 4x4 is 16 "
                                         "chips on 4 host(s) of 4 chips; set hostsPerLearner: 4 "
                                         "(got 1)"),
    (tpu_region("tpu-v6e-slice", "2x4", hostsPerLearner=2), "regions.big.hostsPerLearner: "
                                                            "tpu-v6e-slice 2x4 is 8 chips on 1 host(s)"),
    # not a GKE node label
    (tpu_region("tpu-v5p", "2x2x1"), 'regions.big.accelerator.tpuType: "tpu-v5p" is not a GKE TPU '
                                     "node label (cloud.google.com/gke-tpu-accelerator); use one of "
                                     "tpu-v4-podslice, tpu-v5-lite-podslice, tpu-v5p-slice, "
                                     "tpu-v6e-slice"),
    (tpu_region("tpu-v5p-slice", "2x4"), "regions.big.accelerator.topology: tpu-v5p-slice "
                                         "topologies are AxBxC, got 2x4"),
    (tpu_region("tpu-v6e-slice", "2x2x1"), "regions.big.accelerator.topology: tpu-v6e-slice "
                                           "topologies are AxB, got 2x2x1"),
    (tpu_region("tpu-v4-podslice", "1x1x3"), "regions.big.accelerator.topology: 1x1x3 has 3 chips, "
                                             "not a whole number of tpu-v4-podslice hosts of 4 chips"),
])
def test_unschedulable_accelerators_are_refused_naming_the_key(values, message):
    with pytest.raises(hp.HelmError) as info:
        render(values)
    assert message in str(info.value)


@pytest.mark.parametrize("case, expected", [
    # the home's JobConfig carries its remote regions' devices too: their agents take them
    ("gke-4-regions/home.yaml", {"us-east5": ("tpu", 4, "v5p", "2x2x1"),
                                 "europe-west4": ("tpu", 8, "v6e", "2x4")}),
    ("values-gpu.yaml", {"us-central1-a": ("gpu", 1, None, None),
                         "us-central1-c": ("gpu", 1, None, None)}),
    ("default", {"local": ("cpu", 1, None, None)}),
])
def test_job_config_carries_each_regions_devices(case, expected):
    config = job_config(objects(example_values(case)))
    for name, (accelerator, devices, tpu_type, topology) in expected.items():
        region = config.regions[name]
        assert (region.accelerator, region.tpu_type, region.topology) == (accelerator, tpu_type,
                                                                          topology)
        assert region.devices().devices_per_host == devices and region.devices().hosts == 1


def test_multi_host_gpu_groups_reach_the_job_as_hosts_per_learner():
    values = {"regions": {"local": {**LOCAL, "hostsPerLearner": 2,
                                    "accelerator": {"type": "gpu", "count": 2}}}}
    objs = objects(values)
    assert cluster_spec(objs)["workerGroupSpecs"][0]["numOfHosts"] == 2
    region = job_config(objs).regions["local"]
    assert (region.hosts_per_learner, region.devices().devices_per_host) == (2, 2)


def test_warm_spares_are_pods_of_their_group_and_reach_the_job():
    """A spare is a learner process with a learner's devices: one more worker pod each."""
    values = {"regions": {"local": {**LOCAL, "spares": 1,
                                    "accelerator": {"type": "gpu", "count": 1}}}}
    objs = objects(values)
    group = cluster_spec(objs)["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 4)
    config = job_config(objs)
    assert config.health.spares == {"local": 1} and config.spares_of("local") == 1
    assert config.region_resources() == {"region:local": 4.0}
    # A remote region's spares reach the home's JobConfig for its agent (none at home).
    home = objects({"regions": {"local": LOCAL, "far": {"learners": 1, "remote": True,
                                                          "spares": 2}},
                    "link": {"server": {"enabled": True, **LINK_SECRETS}}})
    config = job_config(home)
    assert config.health.spares == {"far": 2} and config.spares_of("far") == 0
    assert config.configured_spares("far") == 2


def test_the_console_is_served_on_the_head_behind_its_service_and_token():
    objs = objects({"console": {"tokenSecret": {"name": "ops-token", "key": "t"},
                                "allowFrom": [{"namespaceSelector": {"matchLabels": {
                                    "kubernetes.io/metadata.name": "proxy"}}}]}})
    service = next(o for o in objs if o["kind"] == "Service"
                   and o["metadata"]["name"] == "demo-islands-console")
    head = cluster_spec(objs)["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    container = head["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[service["spec"]["ports"][0]["targetPort"]] == 9410
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secret = next(v["secret"] for v in head["spec"]["volumes"] if v["name"] == "console-token")
    assert mounts["console-token"] == "/etc/islands-console" and secret["secretName"] == "ops-token"
    console = job_config(objs).console
    assert (console.host, console.port, console.token_file) == ("0.0.0.0", 9410,
                                                                "/etc/islands-console/t")
    rules = only(objs, "NetworkPolicy")["spec"]["ingress"]
    assert any(r.get("ports") == [{"port": 9410, "protocol": "TCP"}] and r["from"][0][
        "namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "proxy"
               for r in rules)
    # Off: no Service, no port, and the job serves no console.
    off = objects({"console": {"enabled": False}})
    assert not [o for o in off if o["kind"] == "Service" and "console" in o["metadata"]["name"]]
    assert job_config(off).console.enabled is False


def test_a_kept_cluster_renders_no_ttl_which_kuberay_would_refuse():
    kept = only(objects({"job": {"shutdownAfterJobFinishes": False}}), "RayJob")["spec"]
    assert kept["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in kept
    ended = only(objects(), "RayJob")["spec"]
    assert ended["shutdownAfterJobFinishes"] is True and ended["ttlSecondsAfterFinished"] == 600


def test_pod_values_reach_every_ray_pod_and_k8s_job_mode_is_admitted_and_locked_down():
    values = {"pod": {"serviceAccountName": "trainer", "annotations": {"a": "b"},
                      "affinity": {"nodeAffinity": {}}, "shmSize": "8Gi",
                      "extraVolumes": [{"name": "data", "emptyDir": {}}],
                      "extraVolumeMounts": [{"name": "data", "mountPath": "/data"}]},
              "autoscaler": {"enabled": True, "options": {"idleTimeoutSeconds": 120}},
              "job": {"submissionMode": "K8sJobMode"}}
    objs = objects(values)
    job = only(objs, "RayJob")
    assert crd_errors(job) == []
    spec = job["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"]] + spec["workerGroupSpecs"]:
        pod = group["template"]
        assert pod["metadata"]["annotations"] == {"a": "b"}
        assert pod["spec"]["serviceAccountName"] == "trainer" and "affinity" in pod["spec"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {"/dev/shm", "/data"} <= mounts and "data" in volumes
    # The autoscaler's container is as locked down as the chart's own.
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    assert spec["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False
    # K8sJobMode's submitter pod: the release's labels (so the NetworkPolicy admits it to 8265)
    # and the restricted security contexts.
    submitter = job["spec"]["submitterPodTemplate"]
    policy = only(objs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= submitter["metadata"]["labels"].items()
    container = submitter["spec"]["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert submitter["spec"]["securityContext"]["runAsNonRoot"] is True
    # ...with the pods' annotations, placed like the head rather than on an accelerator node.
    assert submitter["metadata"]["annotations"] == {"a": "b"}
    assert "nodeSelector" not in submitter["spec"]
    placed = only(objects({**values, "head": {"nodeSelector": {"pool": "cpu"}}}), "RayJob")
    assert placed["spec"]["submitterPodTemplate"]["spec"]["nodeSelector"] == {"pool": "cpu"}


def test_a_regions_affinity_replaces_the_pods_for_its_workers_only():
    pinned = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east5-a"]}]}]}}}
    shared = {"podAffinity": {}}
    objs = objects({"pod": {"affinity": shared},
                    "regions": {"east": {**LOCAL, "affinity": pinned}, "west": LOCAL}})
    spec = only(objs, "RayJob")["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]}
    assert groups["east"]["affinity"] == pinned
    assert groups["west"]["affinity"] == shared
    assert spec["headGroupSpec"]["template"]["spec"]["affinity"] == shared
    with pytest.raises(Exception, match="nodeAfinity|Additional properties"):   # typed by Kubernetes
        render({"regions": {"east": {**LOCAL, "affinity": {"nodeAfinity": {}}}}})


def test_no_region_is_merged_into_a_users_values_and_none_is_refused_by_name():
    """Before, a default `regions.local` CPU group was merged into every release (a fifth group
    training the model on 1 CPU), and `regions: {}` did not remove it."""
    objs = objects({"regions": {"us-east5": LOCAL}})
    assert [g["groupName"] for g in cluster_spec(objs)["workerGroupSpecs"]] == ["us-east5"]
    assert list(job_config(objs).regions) == ["us-east5"]
    for values in ({}, {"regions": {}}):
        with pytest.raises(Exception, match="regions: no region is named"):
            chart().render(values, name="demo", namespace="train")


def test_head_is_cpu_only_and_declares_no_region():
    for case in CASES:
        head = cluster_spec(objects(example_values(case)))["headGroupSpec"]
        assert "resources" not in head["rayStartParams"]
        limits = head["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert set(limits) == {"cpu", "memory"}, case
        assert "nodeSelector" not in head["template"]["spec"] or not any(
            "tpu" in k for k in head["template"]["spec"]["nodeSelector"])


# -- safe by default, and each switch ---------------------------------------------------------------
def test_safe_defaults():
    objs = objects()
    spec = cluster_spec(objs)
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert not spec["headGroupSpec"].get("enableIngress")
    assert not [o for o in objs if o["kind"] == "Ingress"]
    assert all(o["spec"]["type"] == "ClusterIP" for o in objs if o["kind"] == "Service")
    # Token auth, the token generated by KubeRay for the cluster: the chart renders no Secret and
    # nothing random, so two renders (helm template under Argo CD or Flux) are identical.
    assert spec["authOptions"] == {"mode": "token"}
    assert not [o for o in objs if o["kind"] == "Secret"]
    assert render() == render()
    # No privileged pods; requests and limits on every container.
    for group, container in containers(objs):
        context = container["securityContext"]
        assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert group["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert container["resources"]["requests"] and container["resources"]["limits"]


def test_the_default_image_is_the_one_the_dockerfile_builds():
    """No registry publishes an islands image: the default is the name deploy/Dockerfile's header
    builds (``docker build -t islands:<appVersion>``), and the guides say to push it and set
    ``image.repository``."""
    with open(os.path.join(REPO, "deploy", "Dockerfile")) as f:
        header = f.read()
    built = re.search(r"docker build -t (\S+):(\S+) -f deploy/Dockerfile \.", header)
    assert built, "deploy/Dockerfile's header shows no `docker build -t NAME:TAG` line"
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        app_version = yaml.safe_load(f)["appVersion"]
    assert chart().values["image"]["repository"] == built.group(1)
    assert built.group(2) == app_version
    images = {c["image"] for _, c in containers(objects())}
    assert images == {f"{built.group(1)}:{app_version}"}
    for guide in (os.path.join(CHART, "README.md"), os.path.join(REPO, "docs", "kubernetes.md")):
        with open(guide) as f:
            text = f.read()
        assert "image.repository" in text and "push" in text, guide


def test_network_policy_admits_ray_ports_only_from_the_release():
    objs = objects({"networkPolicy": {"monitoringNamespace": "prom"}})
    policy = only(objs, "NetworkPolicy")["spec"]
    release = {"app.kubernetes.io/name": "islands", "app.kubernetes.io/instance": "demo"}
    assert policy["podSelector"]["matchLabels"] == release
    assert policy["policyTypes"] == ["Ingress"]
    same_release, operator, monitoring = policy["ingress"]
    assert same_release == {"from": [{"podSelector": {"matchLabels": release}}]}
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kuberay-system"}
    assert [p["port"] for p in operator["ports"]] == [8265]
    assert monitoring["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "prom"}
    assert sorted(p["port"] for p in monitoring["ports"]) == [8080, 9400]
    # Every pod of the release carries the labels the policy selects.
    for group, _ in containers(objs):
        assert release.items() <= group["template"]["metadata"]["labels"].items()


def test_each_safety_switch_turns_off():
    objs = objects({"auth": {"enabled": False}, "networkPolicy": {"enabled": False}})
    assert "authOptions" not in cluster_spec(objs)
    assert not [o for o in objs if o["kind"] in ("Secret", "NetworkPolicy")]
    objs = objects({"auth": {"existingSecret": "mine"}})
    assert cluster_spec(objs)["authOptions"]["secretName"] == "mine"
    assert not [o for o in objs if o["kind"] == "Secret"]
    objs = objects({"mode": "cluster", "dashboard": {"ingress": {"enabled": True,
                                                                  "host": "ray.example.com"}}})
    ingress = only(objs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "demo-islands-head-svc", "port": {"name": "dashboard"}}
    kubernetes_validate.validate(ingress, KUBE_VERSION, strict=True)
    with pytest.raises(hp.HelmError, match="only with mode: cluster"):
        render({"dashboard": {"ingress": {"enabled": True, "host": "ray.example.com"}}})


def test_cluster_mode_renders_a_raycluster_and_the_submit_command():
    values = {"mode": "cluster"}
    objs = objects(values)
    cluster = only(objs, "RayCluster")
    assert not [o for o in objs if o["kind"] == "RayJob"]
    assert "restartPolicy" not in cluster["spec"]["headGroupSpec"]["template"]["spec"]
    notes = render(values)["islands/templates/NOTES.txt"]
    assert "ray job submit --address http://127.0.0.1:8265 -- islands run /etc/islands/job.yaml" in notes
    assert "get secret demo-islands -o jsonpath" in notes   # KubeRay's, named after the cluster


def test_monitors_select_the_metrics_service_and_ray_pods():
    objs = objects({"metrics": {"serviceMonitor": {"enabled": True, "additionalLabels": {
        "release": "prom"}}, "podMonitor": {"enabled": True}}})
    service = next(o for o in objs if o["kind"] == "Service"
                   and o["metadata"]["name"].endswith("-metrics"))
    monitor = only(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The Service reaches the head container's islands-metrics port.
    head = cluster_spec(objs)["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports[service["spec"]["ports"][0]["targetPort"]] == 9400
    pods = only(objs, "PodMonitor")
    assert pods["spec"]["podMetricsEndpoints"][0]["port"] == "metrics" and ports["metrics"] == 8080
    assert not [o for o in objects() if o["kind"] in MONITOR_KINDS]   # off by default


def test_grafana_dashboard_configmap_is_the_project_dashboard():
    cm = next(o for o in objects() if o["kind"] == "ConfigMap" and "islands.json" in o["data"])
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    with open(os.path.join(REPO, "deploy", "grafana", "islands.json")) as f:
        assert json.loads(cm["data"]["islands.json"]) == json.load(f), (
            "helm/islands/dashboards/islands.json differs from deploy/grafana/islands.json; copy it")


# -- values.schema.json -----------------------------------------------------------------------------
@pytest.mark.parametrize("values, message", [
    ({"regions": {"x": {"learners": 1, "resources": {"requests": {"cpu": 1}, "limits": {"cpu": 1}}}}},
     "/regions/x': missing property 'accelerator'"),
    ({"regions": {"local": {"learners": -1}}}, "/regions/local/learners': minimum: got -1"),
    ({"replicas": 3}, "additional properties 'replicas' not allowed"),
    ({"regions": {"local": {"replica": 3}}}, "additional properties 'replica' not allowed"),
    ({"regions": {"Us_East": {}}}, "/regions"),
    ({"regions": {"local": {"accelerator": {"type": "tpu", "topology": "2x2x1"}}}}, "/regions/local/accelerator"),
    ({"link": {"enabled": True}}, "additional properties 'enabled' not allowed"),
    ({"link": {"server": {"enabled": True}}}, "/link/server/tokenSecret/name"),
    ({"link": {"server": {"enabled": True, "tokenSecret": {"name": "t"}}}},
     "/link/server/tlsSecret/name"),
    ({"link": {"server": {"enabled": True, "tokenSecret": {"name": "t"}, "tlsSecret": {"name": "c"},
                          "port": 70000}}}, "/link/server/port"),
    ({"link": {"server": {"serviceType": "ExternalName"}}}, "/link/server/serviceType"),
    ({"link": {"region": {"enabled": True, "name": "far", "tokenSecret": {"name": "t"}}}},
     "/link/region/home"),
    ({"link": {"region": {"enabled": True, "home": "home.example.com", "name": "far",
                          "tokenSecret": {"name": "t"}}}}, "/link/region/home"),
    ({"link": {"region": {"enabled": True, "home": "home.example.com:7443",
                          "tokenSecret": {"name": "t"}}}}, "/link/region/name"),
    ({"link": {"region": {"enabled": True, "home": "h:7443", "name": "far"}}},
     "/link/region/tokenSecret/name"),
    ({"link": {"region": {"token": "inline-secret"}}}, "additional properties 'token' not allowed"),
    ({"link": {"server": {"enabled": True, "tokenSecret": {"name": "t"}, "tlsSecret": {"name": "c"}},
               "region": {"enabled": True, "home": "h:7443", "name": "far",
                          "tokenSecret": {"name": "t"}}}}, "/link"),
    ({"regions": {"far": {"remote": False, "learners": 1}}}, "/regions/far': missing properties 'accelerator', 'resources'"),
    ({"jobConfig": {"regions": {}}}, "/jobConfig"),
    # the embedded JobConfig schema: typos and wrong types are refused at render, by key
    ({"jobConfig": {"sycner": {}}}, "at '/jobConfig': additional properties 'sycner' not allowed"),
    ({"jobConfig": {"syncer": {"fragmnets": 3}}},
     "at '/jobConfig/syncer': additional properties 'fragmnets' not allowed"),
    ({"jobConfig": {"quorum": {"min_learners": "two"}}},
     "at '/jobConfig/quorum/min_learners': got string, want integer"),
    # Kubernetes objects passed through are typed with Kubernetes' strict schemas: a typo is
    # refused at render instead of being dropped by the API server
    ({"securityContext": {"runAsNonRot": True}},
     "at '/securityContext': additional properties 'runAsNonRot' not allowed"),
    ({"imagePullSecrets": [{"nmae": "regcred"}]},
     "at '/imagePullSecrets/0': additional properties 'nmae' not allowed"),
    ({"head": {"tolerations": [{"key": "k", "efect": "NoSchedule"}]}},
     "at '/head/tolerations/0': additional properties 'efect' not allowed"),
    ({"pod": {"affinity": {"nodeAfinity": {}}}},
     "at '/pod/affinity': additional properties 'nodeAfinity' not allowed"),
    ({"env": [{"name": "A", "valu": "1"}]}, "at '/env/0': additional properties 'valu' not allowed"),
    ({"autoscaler": {"options": {"securityContext": {"runAsUsr": 1}}}},
     "at '/autoscaler/options/securityContext': additional properties 'runAsUsr' not allowed"),
])
def test_schema_rejects(values, message):
    with pytest.raises(hp.HelmValuesError) as info:
        chart().validate_schema(chart().merge_values(values))
    assert message in str(info.value)
    with pytest.raises(hp.HelmValuesError):
        render(values)


def test_the_embedded_schemas_are_current():
    """values.schema.json embeds the JobConfig's schema and Kubernetes' schemas of the objects it
    passes through; regenerate it with ``python -m islands.orchestrator.helm_schema`` when the
    JobConfig or those values change."""
    from islands.orchestrator import helm_schema

    with open(helm_schema.CHART_SCHEMA) as f:
        assert f.read() == helm_schema.render(), (
            "helm/islands/values.schema.json is out of date with the JobConfig: run "
            "python -m islands.orchestrator.helm_schema")


def test_schema_accepts_defaults_and_examples():
    for case in CASES:
        chart().validate_schema(chart().merge_values(example_values(case)))


def test_every_value_is_documented():
    """Every leaf key of values.yaml has a ``# --`` comment above it or above an ancestor, and
    every top-level key appears in the chart README."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        lines = f.read().splitlines()
    key = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$")
    stack: list[tuple[int, str, bool]] = []   # (indent, key, documented)
    undocumented, comment = [], False
    for i, line in enumerate(lines):
        if line.strip().startswith("# --"):
            comment = True
            continue
        if line.strip().startswith("#") or not line.strip():
            continue
        match = key.match(line)
        if not match:
            comment = False
            continue
        indent, name, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = comment or any(d for _, _, d in stack)
        is_leaf = bool(rest) and not rest.startswith("#")
        if is_leaf and not documented:
            undocumented.append(".".join([k for _, k, _ in stack] + [name]))
        stack.append((indent, name, documented))
        comment = False
    assert undocumented == []
    with open(os.path.join(CHART, "README.md")) as f:
        readme = f.read()
    top = [k for k in chart().values if k != "global"]
    assert [k for k in top if f"`{k}" not in readme] == []


# -- regions in their own clusters: the home's link server and region releases --------------------
LINK_SECRETS = {"tokenSecret": {"name": "link-token"}, "tlsSecret": {"name": "link-tls"}}


def head_pod(objs: list[dict]) -> dict:
    return cluster_spec(objs)["headGroupSpec"]["template"]["spec"]


def mounted_secrets(pod: dict) -> dict[str, tuple[str, list[str]]]:
    """mount path -> (Secret name, its keys) of the head container's Secret volumes."""
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    return {m["mountPath"]: (volumes[m["name"]]["secretName"],
                             [i["key"] for i in volumes[m["name"]]["items"]])
            for m in pod["containers"][0]["volumeMounts"] if m["name"] in volumes}


def job_config(objs: list[dict]):
    cm = next(o for o in objs if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == "demo-islands-job")
    return parse(yaml.safe_load(cm["data"]["job.yaml"]))


def test_home_release_serves_the_link_and_leaves_remote_regions_out():
    values = example_values("values-home-link.yaml")
    objs = objects(values)
    config = job_config(objs)
    remote = [n for n, r in values["regions"].items() if r.get("remote")]
    assert remote == ["europe-west4"] and config.regions["europe-west4"].remote is True
    assert config.regions["us-east5"].remote is False
    assert [g["groupName"] for g in cluster_spec(objs)["workerGroupSpecs"]] == ["us-east5"]
    # JobConfig `link`: the port, every interface, and files where the Secrets are mounted.
    assert (config.link.port, config.link.host) == (7443, "0.0.0.0")
    pod = head_pod(objs)
    secrets = mounted_secrets(pod)
    token_dir, token_file = os.path.split(config.link.token_file)
    assert secrets[token_dir] == ("islands-link-token", [token_file])
    tls_dir = os.path.dirname(config.link.tls.cert_file)
    name, keys = secrets[tls_dir]
    assert name == "islands-link-tls"
    assert sorted(os.path.basename(f) for f in (config.link.tls.cert_file, config.link.tls.key_file,
                                                config.link.tls.client_ca_file)) == sorted(keys)
    assert all(m["readOnly"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] in secrets)
    # The Service exposes the head's link port.
    service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "demo-islands-link")
    (port,) = service["spec"]["ports"]
    assert port["port"] == 7443 and service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports[port["targetPort"]] == 7443
    head_labels = cluster_spec(objs)["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= head_labels.items()
    # The NetworkPolicy opens the link port to the configured sources only.
    rules = only(objs, "NetworkPolicy")["spec"]["ingress"]
    (link_rule,) = [r for r in rules if {"port": 7443, "protocol": "TCP"} in r.get("ports", [])]
    assert link_rule["from"] == [{"ipBlock": {"cidr": "203.0.113.0/24"}}]
    # Secrets are referenced, never inlined: the chart renders none.
    assert not [o for o in objs if o["kind"] == "Secret"]


def test_link_server_defaults_are_cluster_ip_and_open_to_any_source():
    values = {"link": {"server": {"enabled": True, **LINK_SECRETS}},
              "regions": {"local": LOCAL, "far": {"learners": 2, "remote": True}}}
    objs = objects(values)
    service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "demo-islands-link")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 7443
    assert "loadBalancerSourceRanges" not in service["spec"]
    kubernetes_validate.validate(service, KUBE_VERSION, strict=True)
    rules = only(objs, "NetworkPolicy")["spec"]["ingress"]
    assert {"ports": [{"port": 7443, "protocol": "TCP"}]} in rules   # no `from`: any source
    config = job_config(objs)
    assert config.link.tls.client_ca_file is None       # no mutual TLS unless clientCaKey is set
    assert config.link.token_file == "/etc/islands-link/token/token"
    assert sorted(config.regions) == ["far", "local"]
    assert [g["groupName"] for g in cluster_spec(objs)["workerGroupSpecs"]] == ["local"]
    # Off by default: no link Service, no link port, no link in the JobConfig.
    objs = objects()
    assert not [o for o in objs if o["metadata"]["name"].endswith("-link")]
    assert job_config(objs).link.port is None
    assert "islands-link" not in {p["name"] for p in head_pod(objs)["containers"][0]["ports"]}
    assert all(r.get("ports") != [{"port": 7443, "protocol": "TCP"}]
               for r in only(objs, "NetworkPolicy")["spec"]["ingress"])


def test_only_remote_regions_render_an_empty_worker_list():
    values = {"link": {"server": {"enabled": True, **LINK_SECRETS}},
              "regions": {"far": {"learners": 2, "remote": True}}}
    objs = objects(values)
    assert cluster_spec(objs)["workerGroupSpecs"] == []
    assert crd_errors(only(objs, "RayJob")) == []


def test_region_release_renders_one_worker_group_and_the_agent():
    values = example_values("values-region.yaml")
    objs = objects(values)
    job = only(objs, "RayJob")
    (group,) = cluster_spec(objs)["workerGroupSpecs"]
    assert group["groupName"] == "europe-west4"
    assert region_resources(group) == {"region:europe-west4": 1}
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert group["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    # The agent: `islands region join` with the home, the region and files from the Secrets.
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["islands", "region", "join"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--home"] == "islands-link.example.com:7443"
    assert flags["--region"] == "europe-west4" and flags["--address"] == "auto"
    secrets = mounted_secrets(head_pod(objs))
    token_dir, token_key = os.path.split(flags["--token-file"])
    assert secrets[token_dir] == ("islands-link-token", [token_key])
    tls_dir = os.path.dirname(flags["--ca-cert"])
    assert secrets[tls_dir] == ("islands-link-client", ["ca.crt", "tls.crt", "tls.key"])
    assert [os.path.basename(flags[f]) for f in ("--ca-cert", "--client-cert", "--client-key")] == [
        "ca.crt", "tls.crt", "tls.key"]
    # No JobConfig (the agent fetches the home's) and no controller /metrics objects.
    assert not [o for o in objs if o["kind"] in ("ConfigMap", "Service")]
    mounts = [m["mountPath"] for m in head_pod(objs)["containers"][0]["volumeMounts"]]
    assert "/etc/islands" not in mounts
    # It joins as the region the home example marks remote, with the same learner counts.
    home = example_values("values-home-link.yaml")["regions"]["europe-west4"]
    mine = values["regions"]["europe-west4"]
    assert home["remote"] and (home["learners"], home["maxLearners"]) == (
        mine["learners"], mine["maxLearners"])
    assert (group["replicas"], group["maxReplicas"]) == (mine["learners"], mine["maxLearners"])


def test_region_release_without_tls_secret_uses_system_roots():
    values = {"regions": {"far": {
        "learners": 1, "accelerator": {"type": "cpu"},
        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}}},
        "job": {"extraArgs": ["--duration", "600"]},
        "link": {"region": {"enabled": True, "name": "far", "home": "10.0.0.5:7443",
                            "serverName": "link.example.com", "tokenSecret": {"name": "tok"}}}}
    objs = objects(values)
    argv = shlex.split(only(objs, "RayJob")["spec"]["entrypoint"])
    assert "--ca-cert" not in argv and "--client-cert" not in argv
    assert argv[argv.index("--server-name") + 1] == "link.example.com"
    assert argv[-2:] == ["--duration", "600"]
    pod = head_pod(objs)
    assert [v["name"] for v in pod["volumes"] if "secret" in v] == ["link-token"]
    # mode: cluster keeps the cluster up and prints the agent's submit command.
    values["mode"] = "cluster"
    notes = render(values)["islands/templates/NOTES.txt"]
    assert "ray job submit --address http://127.0.0.1:8265 -- islands region join --home 10.0.0.5:7443" in notes
    assert only(objects(values), "RayCluster")


@pytest.mark.parametrize("values, message", [
    ({"regions": {"far": {"learners": 2, "remote": True}}}, "regions.far.remote: a remote region joins"),
    ({"link": {"server": {"enabled": True, **LINK_SECRETS}}, "jobConfig": {"link": {"port": 9000}}},
     "jobConfig.link.port: set by the chart"),
    ({"link": {"region": {"enabled": True, "name": "far", "home": "h:7443",
                          "tokenSecret": {"name": "t"}}}}, 'link.region.name: "far" is not'),
    ({"regions": {"local": LOCAL, "far": {"learners": 1, "accelerator": {"type": "cpu"},
                                          "resources": {"requests": {"cpu": "1"},
                                                        "limits": {"cpu": "1"}}}},
      "link": {"region": {"enabled": True, "name": "far", "home": "h:7443",
                          "tokenSecret": {"name": "t"}}}}, "renders only regions.far; disable the others"),
    ({"regions": {"local": {**LOCAL, "remote": True}},
      "link": {"region": {"enabled": True, "name": "local", "home": "h:7443",
                          "tokenSecret": {"name": "t"}}}}, "regions.local.remote: only a home release"),
])
def test_link_misconfigurations_fail_with_the_key(values, message):
    with pytest.raises(hp.HelmError, match=re.escape(message)):
        render(values)


# -- a deployment of several clusters: one release per cluster, and the releases agree -------------
def link_home(case: str) -> bool:
    return bool(example_values(case).get("link", {}).get("server", {}).get("enabled"))


def deployments() -> list[tuple[str, list[str], list[str]]]:
    """``(folder, link homes, region releases)`` per folder of deploy/helm/ that holds a link home
    or a region release: the releases of one deployment sit side by side."""
    folders = sorted({os.path.dirname(c) for c in CASES[1:] if c in REGION_CASES or link_home(c)})
    return [(folder, [c for c in HOME_CASES[1:] if os.path.dirname(c) == folder and link_home(c)],
             [c for c in REGION_CASES if os.path.dirname(c) == folder]) for folder in folders]


DEPLOYMENTS = deployments()
LINK_NAME = "external-dns.alpha.kubernetes.io/hostname"   # the link's DNS name, on its Service
TPU_LABELS = {"tpu-v4-podslice": "v4", "tpu-v5-lite-podslice": "v5e", "tpu-v5p-slice": "v5p",
              "tpu-v6e-slice": "v6e"}
DEVICE_KEYS = {"tpu": "google.com/tpu", "gpu": "nvidia.com/gpu"}


def test_the_examples_hold_the_deployments_checked_below():
    assert [(f, len(h), len(r)) for f, h, r in DEPLOYMENTS] == [("", 1, 1), ("gke-4-regions", 1, 3)]


@pytest.mark.parametrize("folder, homes, regions", DEPLOYMENTS, ids=[f or "." for f, _, _ in DEPLOYMENTS])
def test_a_homes_remote_regions_are_its_region_releases(folder, homes, regions):
    """The home's remote regions and the region releases beside it match one to one; each release
    dials the home's link address and port; and the agent, which runs the home's JobConfig for its
    region, asks Ray for what the release's worker group has."""
    from islands.orchestrator.region_agent import region_config

    assert len(homes) == 1, f"deploy/helm/{folder}: one link home per deployment, found {homes}"
    home_values = example_values(homes[0])
    remote = sorted(n for n, r in home_values["regions"].items() if r.get("remote"))
    names = [example_values(c)["link"]["region"]["name"] for c in regions]
    assert sorted(names) == remote, f"{homes[0]}'s remote regions against the releases {regions}"
    server = chart().merge_values(home_values)["link"]["server"]
    host = server["annotations"].get(LINK_NAME)
    assert host, f"{homes[0]}: name the link's address (annotation {LINK_NAME})"
    raw = yaml.safe_load(next(o for o in objects(home_values) if o["kind"] == "ConfigMap"
                              and o["metadata"]["name"] == "demo-islands-job")["data"]["job.yaml"])
    for case, name in zip(regions, names):
        values = example_values(case)
        assert values["link"]["region"]["home"] == f"{host}:{server['port']}", case
        agent = region_config(raw, name)
        region, spares = agent.regions[name], agent.spares_of(name)
        devices = region.devices()
        (group,) = cluster_spec(objects(values))["workerGroupSpecs"]
        pod = group["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        wanted = DEVICE_KEYS.get(devices.accelerator)
        assert [k for k in DEVICE_KEYS.values() if k in limits] == ([wanted] if wanted else []), (
            f"{case}: the home's regions.{name} runs its learners on {devices.accelerator}, the "
            f"release's pods have {limits}")
        if wanted:
            assert limits[wanted] == devices.devices_per_host, case
        if devices.accelerator == "tpu":
            selector = pod["nodeSelector"]
            assert (TPU_LABELS[selector["cloud.google.com/gke-tpu-accelerator"]],
                    selector["cloud.google.com/gke-tpu-topology"]) == (devices.tpu_type,
                                                                       devices.topology), case
        assert group["numOfHosts"] == devices.hosts, case
        assert (group["replicas"], group["maxReplicas"]) == (
            region.learners + spares, region.max_learners + spares), case


def cloud_region(name: str):
    """The cloud region of a region or zone name (GCP ``us-east5``, ``us-east5-a``; AWS
    ``us-east-1``, ``us-east-1a``), or None for a name that is neither."""
    found = re.match(r"^([a-z]+-[a-z]+\d+)(-[a-z])?$", name) or re.match(
        r"^([a-z]{2}(?:-gov)?-[a-z]+-\d)[a-z]?$", name)
    return found.group(1) if found else None


def group_cloud_regions(group: dict) -> set:
    """Where a worker group's pods run: the zones or regions its node selector or required node
    affinity names, else its name if that is a cloud region or zone."""
    keys = ("topology.kubernetes.io/region", "topology.kubernetes.io/zone")
    pod = group["template"]["spec"]
    places = [v for k, v in pod.get("nodeSelector", {}).items() if k in keys]
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {})
    places += [v for term in required.get("nodeSelectorTerms", [])
               for e in term.get("matchExpressions", [])
               if e["key"] in keys and e["operator"] == "In" for v in e["values"]]
    return {cloud_region(p) for p in places or [group["groupName"]]} - {None}


def cloud_region_problems(values: dict) -> list:
    """A cluster is in one cloud region: its worker groups must not be in two. Groups that say
    nowhere are allowed side by side only as a demo's emulated regions (with ``latencyMs``)."""
    where = {g["groupName"]: group_cloud_regions(g)
             for g in cluster_spec(objects(values))["workerGroupSpecs"]}
    problems = []
    if len(set().union(*where.values())) > 1:
        problems.append(f"worker groups in several cloud regions: {where}")
    if len(where) > 1:
        problems += [f"regions.{n}: no cloud location beside other regions (and no emulated WAN)"
                     for n, w in where.items()
                     if not w and values["regions"][n].get("latencyMs") is None]
    return problems


@pytest.mark.parametrize("case", CASES[1:])
def test_no_release_puts_two_cloud_regions_in_one_cluster(case):
    assert cloud_region_problems(example_values(case)) == []


def test_the_cloud_region_check_sees_two_regions_in_one_cluster():
    # the former four-region example: GKE's us-east5 and europe-west4 as groups of one cluster
    assert cloud_region_problems({"regions": {"us-east5": LOCAL, "europe-west4": LOCAL}})
    zones = {n: {**LOCAL, "nodeSelector": {"topology.kubernetes.io/zone": z}}
             for n, z in (("a", "us-central1-a"), ("b", "europe-west4-b"))}
    assert cloud_region_problems({"regions": zones})
    zones["b"]["nodeSelector"]["topology.kubernetes.io/zone"] = "us-central1-c"
    assert cloud_region_problems({"regions": zones}) == []
    assert cloud_region_problems({"regions": {"east": LOCAL, "west": LOCAL}})   # says nowhere
    assert (cloud_region("us-east-1a"), cloud_region("us-east5-a"), cloud_region("local")) == (
        "us-east-1", "us-east5", None)


def test_link_notes_say_how_to_join():
    notes = render(example_values("values-home-link.yaml"))["islands/templates/NOTES.txt"]
    assert "Service demo-islands-link (LoadBalancer)" in notes
    assert "--set link.region.name=europe-west4" in notes
    notes = render(example_values("values-region.yaml"))["islands/templates/NOTES.txt"]
    assert "joins the home job at islands-link.example.com:7443" in notes
    assert "islands region join --home islands-link.example.com:7443 --region europe-west4" in notes


@pytest.mark.parametrize("values, message", [
    # what the JobConfig would refuse only after the slices are up, refused at render
    ({"jobConfig": {"quorum": {"min_learners": 5}}},
     "jobConfig.quorum.min_learners: quorum (5) exceeds the learners of all regions (2)"),
    ({"regions": {"local": {**LOCAL, "maxLearners": 1}}},
     "regions.local.maxLearners: 1 is below learners (2)"),
    ({"regions": {"local": {**LOCAL, "minLearners": 4}}},
     "regions.local.minLearners: 4 is above maxLearners (3)"),
    ({"job": {"extraArgs": ["--resume"]}}, "job.extraArgs: --resume: the chart's entrypoint "
                                           "already passes --resume-or-start"),
    # KubeRay's own rules that its CRD schema does not carry
    ({"fullnameOverride": "9islands"}, 'fullnameOverride: object name "9islands"'),
    ({"fullnameOverride": "Islands"}, "must be a DNS-1035 label"),
    ({"rayVersion": "2.51.0"}, "rayVersion: token authentication (auth.enabled) needs Ray >= "
                               "2.52.0, got 2.51.0"),
])
def test_cross_checks_refuse_at_render_naming_the_key(values, message):
    with pytest.raises(hp.HelmError, match=re.escape(message)):
        render(values)


def test_old_ray_renders_without_token_auth():
    assert objects({"rayVersion": "2.51.0", "auth": {"enabled": False}})


def kuberay_rule_violations(obj: dict) -> list[str]:
    """KubeRay v1.7.0's own validation (ray-operator/controllers/ray/utils/validation.go) of what
    its CRD schema does not carry: a DNS-1035 name, a TTL only when the cluster is shut down
    after the job, token auth only on Ray >= 2.52, and worker groups with positive, ordered
    replica bounds and numOfHosts."""
    out = []
    name, kind = obj["metadata"]["name"], obj["kind"]
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
        out.append(f"{kind} {name}: not a DNS-1035 label")
    spec = obj["spec"]
    cluster = spec.get("rayClusterSpec", spec) if kind == "RayJob" else spec
    if kind == "RayJob":
        if spec.get("ttlSecondsAfterFinished") is not None and not spec.get(
                "shutdownAfterJobFinishes"):
            out.append(f"{name}: ttlSecondsAfterFinished without shutdownAfterJobFinishes")
    auth = (cluster.get("authOptions") or {}).get("mode")
    version = tuple(int(x) for x in cluster.get("rayVersion", "0.0.0").split(".")[:2])
    if auth == "token" and version < (2, 52):
        out.append(f"{name}: token auth on Ray {cluster.get('rayVersion')} (< 2.52)")
    for group in cluster.get("workerGroupSpecs", []):
        lo, hi, n = group.get("minReplicas", 0), group.get("maxReplicas", 2 ** 31), group.get(
            "replicas", 0)
        if not (0 <= lo <= n <= hi):
            out.append(f"{name}/{group['groupName']}: replicas {n} outside [{lo}, {hi}]")
        if group.get("numOfHosts", 1) < 1:
            out.append(f"{name}/{group['groupName']}: numOfHosts < 1")
    return out


@pytest.mark.parametrize("case", CASES)
def test_every_example_passes_kuberays_own_rules(case):
    objs = objects(example_values(case) or None)
    ray = [o for o in objs if o["kind"] in RAY_KINDS]
    assert ray and [v for o in ray for v in kuberay_rule_violations(o)] == []


def test_the_kuberay_rule_checker_catches_what_it_checks():
    job = only(objects(), "RayJob")
    bad = json.loads(json.dumps(job))
    bad["metadata"]["name"] = "Demo"
    bad["spec"]["shutdownAfterJobFinishes"] = False
    bad["spec"]["ttlSecondsAfterFinished"] = 60
    bad["spec"]["rayClusterSpec"]["rayVersion"] = "2.51.0"
    bad["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "token"}
    assert len(kuberay_rule_violations(bad)) == 3


def test_notes_point_at_the_submitter_for_the_jobs_output():
    """The job's progress lines are the submitter's output, not the Ray head's."""
    sidecar = render({})["islands/templates/NOTES.txt"]
    assert "-c ray-job-submitter" in sidecar and "-c ray-head\n" not in sidecar
    job_mode = render({"job": {"submissionMode": "K8sJobMode"}})["islands/templates/NOTES.txt"]
    assert "logs -f job/demo-islands" in job_mode


# -- the guide's commands name what the chart renders -------------------------------------------
GUIDE = os.path.join(REPO, "docs", "kubernetes.md")
# Made by KubeRay from a RayJob, not rendered by the chart: the RayCluster (and its head Service
# and generated token Secret) is read from the RayJob's status into these shell variables.
KUBERAY_MADE = {"${CLUSTER}", "${CLUSTER}-head-svc", "${RC}"}


def guide_commands() -> list[str]:
    """Every command of the guide's bash blocks, continuation lines joined, comments dropped."""
    with open(GUIDE) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def guide_releases() -> dict[str, list[list[dict]]]:
    """The releases the guide installs, rendered under its names: ``release -> [objects, ...]``."""
    releases: dict[str, list[list[dict]]] = {}
    for cmd in guide_commands():
        found = re.match(r"helm install (\S+) helm/islands -n (\S+) .*-f (\S+)", cmd)
        if not found:
            continue
        release, namespace, values_file = found.groups()
        # "my-values.yaml" is an example of deploy/helm/ with the user's edits: render each.
        cases = (HOME_CASES[1:] if values_file == "my-values.yaml"
                 else [os.path.relpath(values_file, os.path.join("deploy", "helm"))])
        for case in cases:
            values = with_regions(example_values(case))
            for key, value in re.findall(r"--set (\S+)=(\S+)", cmd):
                *path, leaf = key.split(".")
                node = values
                for part in path:
                    node = node.setdefault(part, {})
                node[leaf] = value
            text = chart().render(values, name=release, namespace=namespace)
            objs = [o for path, body in text.items() if path.endswith(".yaml")
                    for o in yaml.safe_load_all(body) if o]
            releases.setdefault(release, []).append(objs)
    return releases


def _pod_templates(objs: list[dict]) -> list[dict]:
    out = []
    for obj in objs:
        spec = obj.get("spec", {})
        cluster = spec.get("rayClusterSpec", spec) if obj["kind"] in ("RayJob", "RayCluster") else {}
        for group in [cluster.get("headGroupSpec")] + list(cluster.get("workerGroupSpecs", [])):
            if group:
                out.append(group["template"])
    return out


def test_the_guides_commands_name_rendered_objects():
    releases = guide_releases()
    # The home and one release per other region of the four-region example.
    assert set(releases) == {"islands", "islands-us-central1", "islands-europe-west4",
                             "islands-asia-northeast1"}, releases.keys()
    everything = [o for renders in releases.values() for objs in renders for o in objs]
    names = {(o["kind"], o["metadata"]["name"]) for o in everything}
    secrets_used = {v["secret"]["secretName"] for t in _pod_templates(everything)
                    for v in t["spec"].get("volumes", []) if "secret" in v}
    checked = 0
    for cmd in guide_commands():
        if not cmd.startswith(("kubectl -n train", "HEAD=", "RC=", "CLUSTER=", "I=")):
            continue
        checked += 1
        for kind, name in re.findall(r"\b(rayjob|raycluster|svc|job|secret)[ /](\$\{\w+\}[\w-]*|"
                                     r"[a-z][\w-]*)", cmd):
            if name in KUBERAY_MADE or kind == "secret" and name == "generic":
                continue
            if kind in ("rayjob", "job"):   # K8sJobMode's Job is named like its RayJob
                assert ("RayJob", name) in names, cmd
            elif kind == "svc":
                assert ("Service", name) in names, cmd
            elif kind == "raycluster":
                raise AssertionError(f"a RayCluster by a rendered name in: {cmd}")
        created = re.match(r"kubectl -n train create secret generic (\S+)", cmd)
        if created and created.group(1) != "islands-ray-token-gitops":
            assert created.group(1) in secrets_used, cmd
        selector = re.search(r"-l (\S+)", cmd)
        if selector:
            wanted = dict(pair.split("=") for pair in selector.group(1).split(","))
            pods = [t for t in _pod_templates(everything)
                    if wanted.items() <= t["metadata"].get("labels", {}).items()]
            assert pods, f"no rendered pod is selected by {selector.group(1)!r}: {cmd}"
            container = re.search(r"-c (\S+)", cmd)
            if container and container.group(1) != "ray-job-submitter":  # KubeRay's, in SidecarMode
                assert any(c["name"] == container.group(1)
                           for p in pods for c in p["spec"]["containers"]), cmd
        exec_in = re.search(r"exec -it \$\{HEAD\} -c (\S+)", cmd)
        if exec_in:
            heads = [t for objs in releases["islands"] for t in _pod_templates(objs)[:1]]
            assert all(any(c["name"] == exec_in.group(1) for c in h["spec"]["containers"])
                       for h in heads), cmd
    assert checked >= 12   # the parser still finds the guide's commands
    # The GitOps token Secret of the guide is the one auth.existingSecret names.
    job = only(objects({"auth": {"existingSecret": "islands-ray-token-gitops"}}), "RayJob")
    assert job["spec"]["rayClusterSpec"]["authOptions"]["secretName"] == "islands-ray-token-gitops"


def test_a_values_file_of_the_previous_chart_with_a_disabled_local_region_renders():
    """The chart before 0.1.0's regions change had a default ``local`` region, which values files
    dropped with ``local: {disabled: true}`` alone: such a file still renders, without it."""
    previous = {"regions": {"local": {"disabled": True},
                            "us-east": {**LOCAL, "learners": 3, "maxLearners": 4}}}
    chart().validate_schema(chart().merge_values(previous))
    groups = cluster_spec(objects(previous))["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["us-east"], [g["groupName"] for g in groups]
    # A disabled region's keys are still checked, and an enabled one still needs its keys.
    with pytest.raises(hp.HelmValuesError, match="/regions/local/learners"):
        chart().validate_schema(chart().merge_values(
            {"regions": {"local": {"disabled": True, "learners": -1}, "us-east": LOCAL}}))
    with pytest.raises(hp.HelmValuesError, match="missing propert"):
        chart().validate_schema(chart().merge_values(
            {"regions": {"local": {"disabled": False}, "us-east": LOCAL}}))


def test_a_users_task_code_reaches_the_job_as_its_runtime_env():
    """The user's own task module, by URI: KubeRay's ``runtimeEnvYAML`` of the RayJob (Ray
    fetches it on every node); none by default."""
    assert "runtimeEnvYAML" not in only(objects(), "RayJob")["spec"]
    env = {"working_dir": "https://example.com/my_task.zip", "pip": ["flax"]}
    spec = only(objects({"job": {"runtimeEnv": env}}), "RayJob")["spec"]
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == env
    assert crd_errors(only(objects({"job": {"runtimeEnv": env}}), "RayJob")) == []
    with pytest.raises(Exception, match="working_dir"):
        chart().validate_schema(chart().merge_values(
            with_regions({"job": {"runtimeEnv": {"working_dir": 3}}})))
