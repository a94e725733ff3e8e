"""What every benchmark records beside its numbers (machine, versions, command) and its table.

No JAX platform is forced and Ray is never imported here: the GPU machine runs these scripts with
JAX_PLATFORMS=cuda and without Ray.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from typing import Any, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def ensure_islands_importable() -> None:
    """Maps ``islands.*`` to this checkout when the package is not installed (the GPU machine):
    ``islands.learners`` is the top-level ``learners/`` folder (docs/architecture.md#code-layout)."""
    try:
        import islands.learners  # noqa: F401
    except ImportError:
        import types

        pkg = types.ModuleType("islands")
        pkg.__path__ = [os.path.dirname(BENCH_DIR)]
        sys.modules["islands"] = pkg


def dist_version(name: str) -> Optional[str]:
    """An installed distribution's version without importing it (``ray`` stays unimported)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    import jax
    import numpy as np

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "numpy": np.__version__, "ray": dist_version("ray")}


def command_line() -> str:
    """The command as typed, with JAX_PLATFORMS when it was set."""
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("JAX_PLATFORMS",)
                   if k in os.environ)
    return (env + " " if env else "") + shlex.join(["python"] + sys.argv)


def format_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def end_service(controller, run_dir: Optional[str] = None) -> None:
    """A benchmark's teardown of the Ray service it started: the controller shut down (its
    learners and syncer with it) and killed, Ray stopped, the benchmark's own run dir removed.
    Never raises: a broken service must not hide the benchmark's result or error."""
    import contextlib
    import shutil

    import ray

    if controller is not None:
        with contextlib.suppress(Exception):
            ray.get(controller.shutdown.remote(), timeout=120)
        with contextlib.suppress(Exception):
            ray.kill(controller)
    ray.shutdown()
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
