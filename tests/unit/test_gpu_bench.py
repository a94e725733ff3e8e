"""``benchmarks/gpu.py`` and its offline bundle (``benchmarks/gpu_bundle.py``) without a GPU.

The dry run (``python benchmarks/gpu.py --dry-run``) builds the bundle and validates every job
config the GPU run uses; here it builds from the local wheel cache only, into a temporary folder
(it skips, naming the wheels, where they are not cached). Nothing here reaches the network or
writes into the checkout; the small pure pieces (the strip list, wheel tags, the nvidia-smi
parser, the islands mapping for a machine without the package) need neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

import gpu  # noqa: E402
import gpu_bundle  # noqa: E402


# -- the bundle's pure pieces ---------------------------------------------------------------------
def test_strip_list_applied_to_a_ray_wheels_member_names():
    names = ["ray/__init__.py", "ray/_raylet.so", "ray/core/src/ray/raylet/raylet",
             "ray/jars/ray_dist.jar", "ray/rllib/algorithms/ppo.py", "ray/data/dataset.py",
             "ray/serve/api.py", "ray/tune/tuner.py", "ray/llm/__init__.py",
             "ray/train/trainer.py", "ray/dashboard/agent.py", "ray/util/state/api.py",
             "ray/train_utils.py", "ray-2.60.0.dist-info/RECORD"]
    kept = [n for n in names if gpu_bundle.keep_member(n, gpu_bundle.RAY_STRIP)]
    assert kept == ["ray/__init__.py", "ray/_raylet.so", "ray/core/src/ray/raylet/raylet",
                    "ray/dashboard/agent.py", "ray/util/state/api.py", "ray/train_utils.py",
                    "ray-2.60.0.dist-info/RECORD"]


def test_wheel_tags_and_names():
    assert gpu_bundle.wheel_fits("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64."
                                 "manylinux2014_x86_64.whl")
    assert not gpu_bundle.wheel_fits("pydantic_core-2.46.4-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not gpu_bundle.wheel_fits("rpds_py-0.30.0-cp312-cp312-macosx_11_0_arm64.whl")
    assert not gpu_bundle.wheel_fits("rpds_py-0.30.0-cp312-cp312-manylinux_2_17_aarch64.whl")
    assert gpu_bundle.wheel_matches("rpds_py-0.30.0-cp312-cp312-manylinux_2_17_x86_64.whl",
                                    "rpds-py", "0.30.0")
    assert not gpu_bundle.wheel_matches("rpds_py-0.30.0-cp312-cp312-x.whl", "rpds-py", "0.3")


def _fake_wheel(path: str, files: dict[str, tuple[bytes, int]]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 2, 3, 4, 5))
            info.external_attr = (0o100000 | mode) << 16
            z.writestr(info, data)
    return path


def _fake_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    _fake_wheel(str(cache / "fakeray-1.0-cp312-cp312-manylinux2014_x86_64.whl"), {
        "fakeray/__init__.py": (b"VERSION = '1.0'\n", 0o644),
        "fakeray/core/raylet": (b"#!/bin/sh\necho raylet\n", 0o755),
        "fakeray/jars/big.jar": (b"x" * 1000, 0o644),
        "fakeray-1.0.data/scripts/fakeray": (b"#!/bin/sh\n", 0o755),
        "fakeray-1.0.dist-info/RECORD": (b"fakeray/__init__.py,,\nfakeray/jars/big.jar,,\n", 0o644),
    })
    _fake_wheel(str(cache / "fakeyaml-2.0-py3-none-any.whl"), {
        "fakeyaml/__init__.py": (b"", 0o644),
        "fakeyaml-2.0.dist-info/RECORD": (b"", 0o644),
    })
    _fake_wheel(str(cache / "json-9.0-py3-none-any.whl"), {"json/__init__.py": (b"", 0o644)})
    dists = (gpu_bundle.Dist("fakeray", "fakeray", strip=("fakeray/jars/",)),
             gpu_bundle.Dist("fakeyaml", "fakeyaml", always=False),
             gpu_bundle.Dist("json", "json", always=False))   # the stdlib has json: not placed
    versions = {"fakeray": "1.0", "fakeyaml": "2.0", "json": "9.0"}
    return cache, dists, versions


def test_bundle_from_cached_wheels_offline_and_install_sh(tmp_path):
    cache, dists, versions = _fake_cache(tmp_path)
    out = tmp_path / "bundle"
    said = []
    manifest = gpu_bundle.build_bundle(str(out), str(cache), dists=dists, versions=versions,
                                       say=said.append)
    archive = out / gpu_bundle.ARCHIVE_NAME
    assert not manifest["reused"] and manifest["bundle_mib"] < 1 and archive.stat().st_size > 0
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert "site/fakeray/core/raylet" in names and "fakeray/jars/big.jar" not in str(names)
        assert not any("scripts" in n for n in names)
        assert tar.getmember("site/fakeray/core/raylet").mode & 0o111
        record = tar.extractfile("site/fakeray-1.0.dist-info/RECORD").read().decode()
        assert "jars" not in record and "fakeray/__init__.py" in record
        assert "fallback/fakeyaml/fakeyaml/__init__.py" in names
    # A second build with nothing changed reuses the archive.
    assert gpu_bundle.build_bundle(str(out), str(cache), dists=dists, versions=versions,
                                   say=said.append)["reused"]
    target = tmp_path / "site-target"
    proc = subprocess.run(["bash", str(out / "install.sh"), str(target)], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable,
                               "ISLANDS_BUNDLE_ANY_PYTHON": "1"})
    assert proc.returncode == 0, proc.stderr
    site = proc.stdout.strip()
    assert site == str(target / "site") and len(proc.stdout.strip().splitlines()) == 1
    assert os.access(os.path.join(site, "fakeray", "core", "raylet"), os.X_OK)
    assert os.path.exists(os.path.join(site, "fakeyaml", "__init__.py"))   # this Python lacks it
    assert not os.path.exists(os.path.join(site, "json"))                   # this Python has it
    assert not os.path.exists(target / "fallback")


def test_install_sh_refuses_another_python(tmp_path):
    cache, dists, versions = _fake_cache(tmp_path)
    gpu_bundle.build_bundle(str(tmp_path / "b"), str(cache), dists=dists, versions=versions,
                            say=lambda *a: None)
    env = {k: v for k, v in os.environ.items() if k != "ISLANDS_BUNDLE_ANY_PYTHON"}
    proc = subprocess.run(["bash", str(tmp_path / "b" / "install.sh"), str(tmp_path / "t")],
                          capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHON": sys.executable})
    if sys.version_info[:2] == (3, 12):
        assert proc.returncode == 0
    else:
        assert proc.returncode != 0 and "CPython 3.12" in proc.stderr


def test_missing_wheel_without_network_names_it(tmp_path, monkeypatch):
    cache, dists, versions = _fake_cache(tmp_path)
    # pip cannot reach an index: an unroutable proxy and no retries.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(gpu_bundle.BundleError, match=r"nothere==1\.0.*not cached"):
        gpu_bundle.build_bundle(str(tmp_path / "b"), str(cache),
                                dists=dists + (gpu_bundle.Dist("nothere", "nothere"),),
                                versions={**versions, "nothere": "1.0"}, say=lambda *a: None)


# -- the benchmark's pure pieces ------------------------------------------------------------------
def test_utilisation_parser_and_stats():
    lines = ["87, 40321", "[N/A], [N/A]", "", "12 , 512", "NVIDIA-SMI has failed"]
    parsed = [gpu.parse_smi_line(x) for x in lines]
    assert parsed == [(87.0, 40321.0), None, None, (12.0, 512.0), None]
    samples = [(float(i), p[0], p[1]) for i, p in enumerate(parsed) if p]
    assert gpu.util_stats(samples, 0.0, 10.0) == {"samples": 2, "util_mean": 49.5,
                                                   "util_max": 87.0, "memory_max_mib": 40321.0}


def test_backend_read_defensively():
    assert gpu.backend_of({"devices": {"backend": "gpu", "platform": "cuda",
                                       "kind": "NVIDIA H100 80GB HBM3", "count": 1}}) == "gpu"
    assert gpu.backend_of({"state": "training"}) is None
    assert gpu.backend_of({"devices": "cuda:0"}) is None


def test_rates_on_the_learners_own_clock():
    """From the first step seen to the last, on the learner's ``step_at``: the poll times (when
    the samples were taken) do not enter, so a late first poll costs nothing."""
    samples = [(100.0, 1000), (100.0, 1000), (100.5, 1005), (101.2, 1012), (103.0, 1030)]
    assert gpu.own_clock_rate(samples) == pytest.approx(10.0)
    # A learner that has not stepped yet (no step_at) and one that stalled give no rate.
    assert gpu.own_clock_rate([(None, 0), (None, 0), (2.0, 20)]) is None
    assert gpu.own_clock_rate([(7.0, 70)] * 5) is None
    assert gpu.own_clock_rate([]) is None


def test_a_missing_import_is_an_error_naming_it(monkeypatch):
    """No stand-in environment for the bare loop: the failed import is named."""
    monkeypatch.setitem(sys.modules, "islands.orchestrator.runtime", None)
    with pytest.raises(ImportError, match=r"islands\.orchestrator\.runtime"):
        gpu.learner_env("gpu", 1.0, "/nonexistent-cache")


def test_each_jobs_run_dir_is_new_and_kept_under_out(tmp_path):
    first = gpu.job_run_dir(str(tmp_path / "out"), "service")
    second = gpu.job_run_dir(str(tmp_path / "out"), "service")
    assert first != second
    for d in (first, second):
        assert os.path.isdir(d) and os.path.dirname(d) == str(tmp_path / "out" / "runs")
        assert os.path.basename(d).startswith("service-")
    assert os.listdir(first) == []


def test_job_configs_validate_and_fit_one_gpu():
    table = gpu.presets()
    for spec in gpu.JOBS:
        raw = gpu.job_dict(spec, table["mid"])
        assert raw["run"]["dashboard"] is False and raw["console"]["enabled"] is False
        config = gpu.validate(raw, memory_limit_bytes=int(78 * 2 ** 30 * spec.devices_per_host))
        region = config.regions[gpu.REGION]
        assert region.accelerator == "gpu"
        assert (region.learners + spec.spares) * spec.devices_per_host <= 1.0
    # Five learners of a quarter GPU do not fit one GPU: the check names the region.
    from islands.orchestrator.job import CapacityError

    with pytest.raises(CapacityError, match=gpu.REGION):
        gpu.validate(gpu.job_dict(gpu.JobSpec("x", 4, 0.25, spares=1), table["tiny"]))


def test_islands_mapping_without_the_installed_package(tmp_path):
    """What the GPU machine does: ``islands.*`` from this checkout, as pyproject maps it."""
    base = gpu.make_islands_package(str(tmp_path))
    code = f"""
import sys
sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path = [p for p in sys.path if 'islands' not in p.lower()]
for m in [m for m in sys.modules if m.split('.')[0] == 'islands']:
    del sys.modules[m]
sys.path.insert(0, {base!r})
import islands, islands.faults
from islands import CARRY_OVERLAP
from islands.orchestrator.config import parse
from islands.orchestrator.job import run_job
from islands.learners.unit import TrainingSpec
from islands.syncer.core import SyncerCore
print(islands.__file__)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(tmp_path))


def test_without_a_gpu_it_says_so_and_exits_nonzero():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py")], capture_output=True,
                          text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode != 0
    assert "no GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# -- the dry run ----------------------------------------------------------------------------------
def test_dry_run_builds_the_bundle_and_validates_the_configs(tmp_path):
    """From the local wheel cache only (``$ISLANDS_BUNDLE_CACHE`` or ~/.cache/islands/gpu-bundle,
    filled once by ``python benchmarks/gpu_bundle.py``) into a temporary folder: no index is
    reachable and nothing is written into the checkout. Packs the archive (xz -2, ~30 s on 2
    cores) and validates the job configs. Without the wheels cached it skips, naming them."""
    cache = gpu_bundle.default_cache_dir()
    versions = gpu_bundle.pinned_versions()
    missing = sorted(f"{n}=={v}" for n, v in versions.items()
                     if gpu_bundle.cached_wheel(cache, n, v) is None)
    if missing:
        pytest.skip(f"the GPU bundle's wheels are not cached in {cache}: {' '.join(missing)} "
                    "(`python benchmarks/gpu_bundle.py` caches them where an index is reachable)")
    bundle_dir = tmp_path / "bundle"
    # pip cannot reach an index: every wheel must come from the cache.
    env = {**os.environ, "ISLANDS_BUNDLE_CACHE": cache, "PIP_NO_INDEX": "1",
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--dry-run",
                           "--bundle-dir", str(bundle_dir), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=540, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dry_run"] is True
    assert 0 < result["bundle_mib"] <= 64
    assert result["bundle"] == str(bundle_dir / gpu_bundle.ARCHIVE_NAME)
    assert os.path.exists(result["bundle"])
    assert os.path.exists(bundle_dir / "install.sh")
    assert result["configs"] == ["bench-gpu-service", "bench-gpu-share4", "bench-gpu-spare"]
    assert result["dists"]["ray"] == versions["ray"]
    assert time.time() - t0 < 540


def test_the_dry_run_without_the_wheels_cached_or_an_index_names_them(tmp_path):
    """What a machine without the cache and without an index gets: one line naming the wheels,
    exit 2, and no bundle."""
    env = {**os.environ, "ISLANDS_BUNDLE_CACHE": str(tmp_path / "empty-cache"),
           "PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--dry-run",
                           "--bundle-dir", str(tmp_path / "bundle"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    ray_pin = f"ray=={gpu_bundle.pinned_versions()['ray']}"
    assert "gpu.py --dry-run: the wheels" in proc.stderr and ray_pin in proc.stderr, proc.stderr
    assert "not cached in " + str(tmp_path / "empty-cache") in proc.stderr, proc.stderr
    assert not (tmp_path / "bundle" / gpu_bundle.ARCHIVE_NAME).exists()
