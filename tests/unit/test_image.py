"""The container image (deploy/Dockerfile) carries the whole package: its build context is
assembled here exactly as Docker would (the COPY lines of the stage that builds the wheel, less
.dockerignore), the wheel is built and installed into a temporary folder, and every module of
the package imports from there. No Docker and no network are needed."""

import fnmatch
import os
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")


def dockerfile_lines(path: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    out, cur = [], ""
    for raw in open(path).read().splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def wheel_stage_copies(lines: list[str]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each context COPY of the stage named ``wheel``."""
    copies, stage = [], None
    for line in lines:
        words = shlex.split(line)
        if words[0].upper() == "FROM":
            stage = words[-1] if len(words) >= 4 and words[-2].upper() == "AS" else None
        elif words[0].upper() == "COPY" and stage == "wheel":
            args = [w for w in words[1:] if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in words), line
            copies.append((args[:-1], args[-1]))
    return copies


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule, for the patterns this repo uses (no `!` exceptions)."""
    parts = rel.split("/")
    for pat in patterns:
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(p, pat[3:]) for p in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
            return True
    return False


def build_context(dest: str) -> None:
    patterns = [ln.strip() for ln in open(os.path.join(REPO, ".dockerignore"))
                if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled here"
    copies = wheel_stage_copies(dockerfile_lines(DOCKERFILE))
    assert copies, "the Dockerfile has no stage `wheel` copying from the context"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    for sources, target in copies:
        assert target in (".", "./"), f"only whole-context copies are modelled: {sources} {target}"
        for src in sources:
            src = src.rstrip("/")
            for rel in tracked:
                if src not in (".", "") and rel != src and not rel.startswith(src + "/"):
                    continue
                if ignored(rel, patterns) or not os.path.isfile(os.path.join(REPO, rel)):
                    continue
                os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
                shutil.copy2(os.path.join(REPO, rel), os.path.join(dest, rel))


def test_dockerignore_rule():
    pats = ["**/__pycache__", "runs", "benchmarks/out", ".git"]
    assert ignored("runs/demo/summary.json", pats) and ignored("learners/__pycache__/x.pyc", pats)
    assert ignored("benchmarks/out/a.png", pats) and not ignored("benchmarks/soak.py", pats)
    assert not ignored("orchestrator/runs.py", pats) and not ignored("link/link.proto", pats)


def test_the_image_installs_every_module_of_the_package(tmp_path):
    pytest.importorskip("setuptools", minversion="70.1")  # bdist_wheel built in: no `wheel`
    context, wheels, site = tmp_path / "context", tmp_path / "wheels", tmp_path / "site"
    build_context(str(context))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--wheel-dir", str(wheels),
                    str(context)], check=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    (wheel,) = wheels.glob("islands-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True)
    # The installed package's own list of modules, imported one by one from the target folder
    # (which comes before the editable install of this checkout on the path).
    probe = (
        "import importlib, pkgutil, sys, islands\n"
        f"assert islands.__path__[0].startswith({str(site)!r}), islands.__path__\n"
        "names = [m.name for m in pkgutil.walk_packages(islands.__path__, 'islands.')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "print(len(names), ' '.join(sorted({n.split('.')[1] for n in names})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    count, folders = out.stdout.split(maxsplit=1)
    expected = {d.split(".")[1] for d in _pyproject_packages() if d != "islands"}
    assert set(folders.split()) >= expected, (folders, expected)
    # Every module file of every package folder made it into the wheel.
    sources = sum(1 for pkg, folder in _package_dirs().items() if pkg != "islands"
                  for f in os.listdir(os.path.join(REPO, folder)) if f.endswith(".py")
                  and f != "__init__.py")
    assert int(count) >= sources, (count, sources)


def _pyproject_packages() -> list[str]:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


def _package_dirs() -> dict:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def test_the_image_sets_no_jax_environment():
    """The job decides each process's JAX variables (orchestrator/runtime.py): an image value
    would only mislead, since every process's own value replaces it."""
    from islands.orchestrator.runtime import MANAGED_ENV

    envs = [ln for ln in dockerfile_lines(DOCKERFILE) if ln.upper().startswith("ENV ")]
    for line in envs:
        for name in MANAGED_ENV:
            assert name not in line, f"deploy/Dockerfile sets {name}: {line}"
    assert any("PYTHONPATH=/opt/islands/user" in ln for ln in envs)

