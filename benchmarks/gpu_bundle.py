"""The offline bundle of what a GPU machine lacks to run the service (``benchmarks/gpu.py``).

The GPU machines of this workplace have Python 3.12, JAX (CUDA), optax, orbax, flax, grpcio,
protobuf, pyyaml, prometheus-client, aiohttp, psutil and matplotlib, but no Ray, pydantic or
jsonschema, and no network. This script downloads (``pip download``, cached) the cp312 manylinux
x86_64 wheels of:

* always installed: ``ray`` (the version installed here, stripped of ``ray/jars``, ``rllib``,
  ``data``, ``serve``, ``tune``, ``llm``, ``train``: 79 MB → about 33 MiB compressed), ``pydantic``,
  ``pydantic-core``, ``annotated-types``, ``typing-inspection`` (the job config),
  ``typing-extensions`` (pydantic needs a recent one), and ``jsonschema`` with
  ``jsonschema-specifications``, ``referencing``, ``rpds-py`` (``import ray`` imports jsonschema);
* installed only where the GPU machine's Python cannot import them already (fallbacks; the
  image has them): ``prometheus-client``, ``pyyaml``, ``msgpack``, ``click``, ``filelock``,
  ``attrs``, ``packaging``, ``protobuf``, and ``requests`` with ``urllib3``, ``idna``,
  ``certifi``, ``charset-normalizer`` (``import ray`` imports requests).

Not bundled: ``aiohttp`` and the rest of ``ray[default]`` (the Ray dashboard's packages). The
benchmark's jobs run with ``run.dashboard: false`` and ``console.enabled: false``, so neither the
Ray dashboard nor the islands console (the one islands module that imports aiohttp) starts;
Ray's per-node agent runs in its minimal mode without the dashboard's packages. ``grain`` (the
Flax task's data) is not needed by the built-in byte LM the benchmark trains.

The wheels are unpacked (not installed: no pip needed there) into ``site/`` (always) and
``fallback/<dist>/`` inside one ``bundle/islands-gpu-bundle.tar.xz`` (xz -T0), next to
``bundle/install.sh`` and ``bundle/manifest.json``; ``bundle/`` is ignored by git and travels to
the GPU machine as a carried path. There::

    export PYTHONPATH="$(bash bundle/install.sh /tmp/islands-gpu)"
    python benchmarks/gpu.py

``install.sh`` extracts the archive with the machine's own Python (no network, no pip), moves a
fallback into ``site/`` only where that Python cannot import the package, and prints the
directory to put on ``PYTHONPATH`` as its only line of standard output.

    python benchmarks/gpu_bundle.py            # build (or reuse) bundle/, print its size
    python benchmarks/gpu_bundle.py --force    # rebuild even when nothing changed

Downloads are cached in ``$ISLANDS_BUNDLE_CACHE`` (default ``~/.cache/islands/gpu-bundle``), so a
rebuild works offline; without the wheels cached and without PyPI it fails saying which wheels
are missing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from typing import Iterable, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
BUNDLE_DIR = os.path.join(REPO_DIR, "bundle")
ARCHIVE_NAME = "islands-gpu-bundle.tar.xz"
LIMIT_MIB = 64.0             # what one device run may carry (the working tree included)
PYTHON_VERSION = "3.12"      # the GPU machine's Python
FORMAT = 2                   # bumps when the archive's layout changes (a rebuild follows)

# Folders of the Ray wheel the service never imports (the JVM jars, the libraries on top of
# Ray Core). Removing them takes the wheel from 79 MB to about 33 MiB compressed (xz -2).
RAY_STRIP = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/", "ray/llm/",
             "ray/train/")

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Dist:
    """One distribution of the bundle: its name on PyPI, the module that shows it is present,
    and whether it is always installed or only where the GPU machine lacks it."""

    name: str
    module: str
    always: bool = True
    strip: tuple = ()


DISTS = (
    Dist("ray", "ray", strip=RAY_STRIP),
    Dist("pydantic", "pydantic"),
    Dist("pydantic-core", "pydantic_core"),
    Dist("annotated-types", "annotated_types"),
    Dist("typing-inspection", "typing_inspection"),
    Dist("typing-extensions", "typing_extensions"),
    Dist("jsonschema", "jsonschema"),
    Dist("jsonschema-specifications", "jsonschema_specifications"),
    Dist("referencing", "referencing"),
    Dist("rpds-py", "rpds"),
    Dist("prometheus-client", "prometheus_client", always=False),
    Dist("pyyaml", "yaml", always=False),
    Dist("msgpack", "msgpack", always=False),
    Dist("click", "click", always=False),
    Dist("filelock", "filelock", always=False),
    Dist("attrs", "attr", always=False),
    Dist("packaging", "packaging", always=False),
    Dist("protobuf", "google.protobuf", always=False),
    Dist("requests", "requests", always=False),      # ``import ray`` imports it
    Dist("urllib3", "urllib3", always=False),
    Dist("idna", "idna", always=False),
    Dist("certifi", "certifi", always=False),
    Dist("charset-normalizer", "charset_normalizer", always=False),
)


class BundleError(RuntimeError):
    """The bundle cannot be built; the message says what is missing and what to do."""


# -- small pure helpers ------------------------------------------------------------------------
def normalize(name: str) -> str:
    """A distribution name as wheel files spell it (PEP 427/503).

    >>> normalize("Pydantic-Core"), normalize("ruamel.yaml")
    ('pydantic_core', 'ruamel_yaml')
    """
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_matches(filename: str, name: str, version: str) -> bool:
    """Whether ``filename`` is a wheel of ``name`` at ``version``.

    >>> wheel_matches("PyYAML-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl", "pyyaml", "6.0.3")
    True
    >>> wheel_matches("pydantic_core-2.46.4-cp312-cp312-x.whl", "pydantic", "2.46.4")
    False
    """
    if not filename.endswith(".whl"):
        return False
    parts = filename[:-4].split("-")
    return len(parts) >= 5 and normalize(parts[0]) == normalize(name) and parts[1] == version


def wheel_fits(filename: str, python: str = PYTHON_VERSION) -> bool:
    """Whether a wheel's tags fit CPython ``python`` on x86-64 Linux (pure or manylinux).

    >>> wheel_fits("ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl")
    True
    >>> wheel_fits("ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl")
    False
    >>> wheel_fits("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl")
    True
    >>> wheel_fits("click-8.4.0-py3-none-any.whl")
    True
    """
    parts = filename[:-4].split("-")
    pythons, abi, plats = parts[-3].split("."), parts[-2], parts[-1].split(".")
    cp = "cp" + python.replace(".", "")
    if abi == "none" and "any" in plats:
        return any(p in ("py3", "py2.py3") or p == cp for p in pythons)
    if not any(p.startswith("manylinux") and p.endswith("x86_64") for p in plats):
        return False
    if abi == "abi3":
        return any(p.startswith("cp3") and int(p[3:]) <= int(cp[3:]) for p in pythons)
    return cp in pythons and abi == cp


def keep_member(name: str, strip: Iterable[str]) -> bool:
    """Whether a wheel member stays in the bundle (not under a stripped folder).

    >>> strip = ("ray/jars/", "ray/rllib/")
    >>> [keep_member(n, strip) for n in ("ray/jars/ray_dist.jar", "ray/rllib", "ray/actor.py",
    ...                                   "ray/rllib/__init__.py", "ray/rllib_contrib.py")]
    [False, False, True, False, True]
    """
    return not any(name.startswith(p) or name + "/" == p for p in strip)


def member_target(name: str) -> Optional[str]:
    """Where a wheel member goes in a site folder: ``*.data/purelib|platlib/x`` → ``x``;
    other ``.data`` members (scripts, headers, data) are left out (nothing runs them).

    >>> member_target("ray/__init__.py"), member_target("x-1.0.data/platlib/x.so")
    ('ray/__init__.py', 'x.so')
    >>> member_target("ray-2.60.0.data/scripts/ray") is None
    True
    """
    head, _, rest = name.partition("/")
    if head.endswith(".data"):
        kind, _, path = rest.partition("/")
        return path if kind in ("purelib", "platlib") and path else None
    return name


def filter_record(text: str, strip: Iterable[str]) -> str:
    """A wheel's RECORD without the lines of stripped members.

    >>> filter_record("ray/a.py,sha256=x,1\\nray/jars/j.jar,sha256=y,2\\n", ("ray/jars/",))
    'ray/a.py,sha256=x,1\\n'
    """
    lines = [line for line in text.splitlines() if line and keep_member(line.split(",")[0], strip)]
    return "".join(line + "\n" for line in lines)


def mib(n_bytes: int) -> float:
    return round(n_bytes / 2 ** 20, 2)


# -- the wheels --------------------------------------------------------------------------------
def pinned_versions(dists=DISTS) -> dict[str, str]:
    """The version of each bundled distribution: the one installed here, which the project's
    tests run against (Ray above all: ``importlib.metadata.version("ray")``)."""
    from importlib import metadata

    out, missing = {}, []
    for d in dists:
        try:
            out[d.name] = metadata.version(d.name)
        except metadata.PackageNotFoundError:
            missing.append(d.name)
    if missing:
        raise BundleError(f"not installed here, so no version to bundle: {', '.join(missing)} "
                          "(pip install -e '.[dev]' installs them)")
    return out


def default_cache_dir() -> str:
    if os.environ.get("ISLANDS_BUNDLE_CACHE"):
        return os.environ["ISLANDS_BUNDLE_CACHE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "islands", "gpu-bundle")


def cached_wheel(cache_dir: str, name: str, version: str) -> Optional[str]:
    if not os.path.isdir(cache_dir):
        return None
    for f in sorted(os.listdir(cache_dir)):
        if wheel_matches(f, name, version) and wheel_fits(f):
            return os.path.join(cache_dir, f)
    return None


def fetch_wheels(versions: dict[str, str], cache_dir: str, say=print) -> dict[str, str]:
    """{name: wheel path}, downloading into ``cache_dir`` only what is not cached there."""
    os.makedirs(cache_dir, exist_ok=True)
    missing = {n: v for n, v in versions.items() if cached_wheel(cache_dir, n, v) is None}
    if missing:
        pins = [f"{n}=={v}" for n, v in sorted(missing.items())]
        say(f"gpu_bundle: downloading {len(pins)} wheels for CPython {PYTHON_VERSION} "
            f"x86_64 into {cache_dir}: {' '.join(pins)}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--python-version", PYTHON_VERSION,
               "--implementation", "cp", "--abi", "cp" + PYTHON_VERSION.replace(".", ""),
               "--abi", "abi3", "--abi", "none", "-d", cache_dir]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        try:
            out = subprocess.run(cmd + pins, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            out = None
            detail = str(exc)
        else:
            detail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            detail = " | ".join(detail)
        still = [n for n, v in missing.items() if cached_wheel(cache_dir, n, v) is None]
        if out is None or out.returncode != 0 or still:
            raise BundleError(
                f"the wheels {', '.join(f'{n}=={missing[n]}' for n in (still or missing))} are "
                f"not cached in {cache_dir} and could not be downloaded from PyPI (no network?). "
                f"Run `python benchmarks/gpu_bundle.py` once where PyPI is reachable, or copy "
                f"the wheels there. pip said: {detail}")
    return {n: cached_wheel(cache_dir, n, v) for n, v in versions.items()}


# -- the archive -------------------------------------------------------------------------------
def bundle_members(dist: Dist, wheel_path: str):
    """Yields (path in the archive, mode, bytes, mtime) for one wheel, stripped; ``site/`` for
    what is always installed, ``fallback/<dist>/`` for the rest."""
    prefix = "site/" if dist.always else f"fallback/{normalize(dist.name)}/"
    with zipfile.ZipFile(wheel_path) as z:
        for info in z.infolist():
            if info.is_dir() or not keep_member(info.filename, dist.strip):
                continue
            target = member_target(info.filename)
            if target is None:
                continue
            data = z.read(info)
            if target.endswith(".dist-info/RECORD") and dist.strip:
                data = filter_record(data.decode(), dist.strip).encode()
            mode = (info.external_attr >> 16) & 0o777
            # Keep what is executable (Ray's raylet, gcs_server) executable.
            mode = 0o755 if mode & 0o111 else 0o644
            mtime = int(time.mktime(info.date_time + (0, 0, -1)))
            yield prefix + target, mode, data, mtime


def install_script() -> str:
    """``bundle/install.sh``: extract with the machine's Python, place the fallbacks it lacks,
    print the site folder (stdout's only line)."""
    return r'''#!/usr/bin/env bash
# Unpacks the islands GPU bundle (benchmarks/gpu_bundle.py) with no network and no pip:
#   export PYTHONPATH="$(bash bundle/install.sh [TARGET_DIR])"    # default /tmp/islands-gpu
# Prints the folder to put on PYTHONPATH as its only line of standard output; says what it did
# on standard error. PYTHON picks the interpreter (default python3; the bundle is for 3.12).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="${1:-/tmp/islands-gpu}"
"${PYTHON:-python3}" - "$here/islands-gpu-bundle.tar.xz" "$target" <<'PY'
import importlib.util, json, os, shutil, sys, tarfile
archive, target = sys.argv[1], os.path.abspath(sys.argv[2])
with tarfile.open(archive) as tar:
    manifest = json.load(tar.extractfile("manifest.json"))
    want = manifest["python"]
    have = "%d.%d" % sys.version_info[:2]
    if have != want and not os.environ.get("ISLANDS_BUNDLE_ANY_PYTHON"):
        sys.exit(f"install.sh: the bundle holds CPython {want} wheels, this is Python {have} "
                 "(set PYTHON=python" + want + ")")
    # Only a folder this script made before is replaced; anything else there is the user's.
    marker = os.path.join(target, ".islands-gpu-bundle")
    if os.path.isdir(target) and os.listdir(target) and not os.path.exists(marker):
        sys.exit(f"install.sh: {target} exists and was not made by install.sh: name a new or "
                 "empty folder")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    open(marker, "w").close()
    kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
    tar.extractall(target, **kw)
site = os.path.join(target, "site")
for d in manifest["dists"]:
    if d["always"]:
        continue
    src = os.path.join(target, "fallback", d["dir"])
    if importlib.util.find_spec(d["module"].split(".")[0]) is not None and (
            "." not in d["module"] or importlib.util.find_spec(d["module"]) is not None):
        print(f"install.sh: {d['name']}: this Python has it", file=sys.stderr)
        continue
    for entry in os.listdir(src):
        dst = os.path.join(site, entry)
        if os.path.isdir(dst) and os.path.isdir(os.path.join(src, entry)):
            shutil.copytree(os.path.join(src, entry), dst, dirs_exist_ok=True)
        else:
            shutil.move(os.path.join(src, entry), dst)
    print(f"install.sh: {d['name']} {d['version']}: from the bundle", file=sys.stderr)
shutil.rmtree(os.path.join(target, "fallback"), ignore_errors=True)
print("install.sh: " + ", ".join(f"{d['name']} {d['version']}" for d in manifest["dists"]
                                 if d["always"]) + f" in {site}", file=sys.stderr)
print(site)
PY
'''


def _xz_pipe(path: str, preset: int):
    """A writable pipe into ``xz -T0`` writing ``path`` (None where there is no xz binary)."""
    xz = shutil.which("xz")
    if xz is None:
        return None, None
    out = open(path, "wb")
    proc = subprocess.Popen([xz, "-T0", f"-{preset}", "-c"], stdin=subprocess.PIPE, stdout=out)
    return proc, out


def write_archive(path: str, members, manifest: dict, preset: int = 2) -> None:
    """Writes the tar.xz of ``members`` ``(name, mode, bytes[, mtime])`` after ``manifest.json``
    (the wheels' own dates, no owners: the same wheels give the same tar)."""
    tmp = path + ".part"
    proc, out = _xz_pipe(tmp, preset)
    if proc is not None:
        tar = tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT)
    else:   # no xz binary: Python's lzma, one thread
        tar = tarfile.open(tmp, mode="w:xz", preset=preset, format=tarfile.PAX_FORMAT)

    def add(name: str, mode: int, data: bytes, mtime: int = 0) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), mode, max(0, mtime)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(data))

    try:
        add("manifest.json", 0o644, json.dumps(manifest, indent=1).encode())
        for member in members:
            add(*member)
        tar.close()
    finally:
        if proc is not None:
            proc.stdin.close()
            rc = proc.wait()
            out.close()
            if rc != 0:
                raise BundleError(f"xz failed with exit status {rc}")
    os.replace(tmp, path)


def bundle_key(wheels: dict[str, str], dists=DISTS) -> str:
    """What the archive is made of: the wheels (names and sizes), the strip lists, the layout
    and the install script; the same key means the archive on disk can be reused."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "python": PYTHON_VERSION,
                         "dists": [[d.name, d.module, d.always, list(d.strip)] for d in dists],
                         "wheels": {n: [os.path.basename(p), os.path.getsize(p)]
                                    for n, p in sorted(wheels.items())},
                         "install": install_script()}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_bundle(out_dir: str = BUNDLE_DIR, cache_dir: Optional[str] = None, force: bool = False,
                 dists=DISTS, versions: Optional[dict] = None, preset: int = 2,
                 say=print) -> dict:
    """Builds (or reuses) ``out_dir/islands-gpu-bundle.tar.xz``, ``install.sh`` and
    ``manifest.json``; returns the manifest with ``bundle_mib`` and ``reused``.

    Raises:
      BundleError: a wheel is neither cached nor downloadable, or the archive is over 64 MiB.
    """
    t0 = time.time()
    cache_dir = cache_dir or default_cache_dir()
    versions = versions or pinned_versions(dists)
    wheels = fetch_wheels(versions, cache_dir, say=say)
    key = bundle_key(wheels, dists)
    archive = os.path.join(out_dir, ARCHIVE_NAME)
    manifest_path = os.path.join(out_dir, "manifest.json")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "install.sh"), "w") as f:
        f.write(install_script())
    os.chmod(os.path.join(out_dir, "install.sh"), 0o755)
    old = None
    if os.path.exists(manifest_path) and os.path.exists(archive):
        with open(manifest_path) as f:
            old = json.load(f)
    if not force and old is not None and old.get("key") == key:
        manifest = dict(old, bundle_mib=mib(os.path.getsize(archive)), reused=True,
                        seconds=round(time.time() - t0, 1))
        say(f"gpu_bundle: {archive} is up to date ({manifest['bundle_mib']} MiB)")
        return manifest
    manifest = {"key": key, "format": FORMAT, "python": PYTHON_VERSION,
                "platform": "manylinux x86_64",
                "dists": [{"name": d.name, "version": versions[d.name], "module": d.module,
                           "always": d.always, "dir": normalize(d.name),
                           "wheel": os.path.basename(wheels[d.name]),
                           "stripped": list(d.strip)} for d in dists]}
    sizes = {}

    def members():
        for d in dists:
            n = 0
            for member in bundle_members(d, wheels[d.name]):
                n += len(member[2])
                yield member
            sizes[d.name] = n

    say(f"gpu_bundle: packing {len(dists)} wheels into {archive} (xz -{preset})")
    write_archive(archive, members(), manifest, preset=preset)
    size = os.path.getsize(archive)
    manifest.update(unpacked_mib={n: mib(s) for n, s in sizes.items()}, archive=ARCHIVE_NAME)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
    if mib(size) > LIMIT_MIB:
        raise BundleError(f"{archive} is {mib(size)} MiB, over the {LIMIT_MIB:g} MiB a device run "
                          "may carry; strip more of the Ray wheel (RAY_STRIP)")
    manifest.update(bundle_mib=mib(size), reused=False, seconds=round(time.time() - t0, 1))
    say(f"gpu_bundle: {archive}: {manifest['bundle_mib']} MiB ({sum(sizes.values()) / 2**20:.0f} "
        f"MiB unpacked) in {manifest['seconds']} s")
    return manifest


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=BUNDLE_DIR, help="the bundle folder (ignored by git)")
    parser.add_argument("--cache", default=None, help="the wheel cache (default "
                        "$ISLANDS_BUNDLE_CACHE or ~/.cache/islands/gpu-bundle)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--preset", type=int, default=2,
                        help="xz preset 0-9 (2: ~36 MiB in ~30 s on 2 cores; 6: ~32 MiB, ~2 min)")
    args = parser.parse_args(argv)
    try:
        manifest = build_bundle(args.out, args.cache, force=args.force, preset=args.preset,
                                say=lambda *a: print(*a, file=sys.stderr, flush=True))
    except BundleError as exc:
        print(f"gpu_bundle: {exc}", file=sys.stderr)
        raise SystemExit(2)
    summary = {"bundle": os.path.join(args.out, ARCHIVE_NAME), "bundle_mib": manifest["bundle_mib"],
               "reused": manifest["reused"], "seconds": manifest["seconds"],
               "dists": {d["name"]: d["version"] for d in manifest["dists"]}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
