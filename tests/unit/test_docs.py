"""The user docs: the generated config reference, every metric, working links, no references to
material users do not have, and the ``islands config`` command (no Ray)."""

import glob
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from islands.orchestrator import cli, config_docs, metrics
from islands.orchestrator.config import JobConfig, load_config
from islands.syncer.validate import REJECT_REASONS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
PAGES = ("README.md", "architecture.md", "config.md", "metrics.md", "operations.md",
         "accelerators.md", "install.md", "quickstart-gpu.md", "troubleshooting.md", "faq.md")
MARKDOWN = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [os.path.join(REPO, "README.md")]
EXAMPLE = os.path.join(REPO, "deploy", "examples", "local.yaml")
# What a user must never be sent to: the team's internal design notes and shared folder.
FORBIDDEN = (re.compile(r"DESIGN\s*§"), re.compile(r"DESIGN\.md"), re.compile(r"shared/"),
             re.compile(r"shared folder", re.IGNORECASE), re.compile(r"team's shared"),
             # the team's own tracker and machines mean nothing to a user
             re.compile(r"\bissue \d+", re.IGNORECASE), re.compile(r"development machine"),
             re.compile(r"machines? lent here"))


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def forbidden_in(text: str) -> list[str]:
    return [m.group(0) for pattern in FORBIDDEN for m in pattern.finditer(text)]


# -- the pages -----------------------------------------------------------------------------------
def test_every_page_exists():
    missing = [p for p in PAGES if not os.path.isfile(os.path.join(DOCS, p))]
    assert not missing, f"docs/ lacks {missing}"


def test_config_reference_is_generated_from_the_schema():
    committed = read(os.path.join(DOCS, "config.md"))
    rendered = config_docs.render_markdown()
    if committed != rendered:
        old, new = committed.splitlines(), rendered.splitlines()
        line = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(f"docs/config.md is out of date with the JobConfig schema (first difference at "
                    f"line {line + 1}); regenerate it with `{config_docs.GENERATE_COMMAND}`")


def test_config_reference_describes_every_field_deterministically():
    assert config_docs.missing_descriptions() == [], (
        "fields with neither a description= in orchestrator/config.py nor an entry in "
        "config_docs.FIELD_NOTES")
    assert config_docs.render_markdown() == config_docs.render_markdown()
    text = config_docs.render_markdown()
    for path in ("quorum.min_learners", "syncer.fragments", "regions.<name>.learners",
                 "chaos.events[].target", "compression.block_size", "health.restart.backoff_max_s"):
        assert f"`{path}`" in text, path
    for name in JobConfig.model_fields:
        assert f"| `{name}` |" in text, f"top-level key {name} is not in the reference"


def _metric_rows(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\| `(islands_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            rows.append((m.group(1), m.group(2), tuple(re.findall(r"`([a-z_]+)`", m.group(3)))))
    return rows


def test_every_exported_metric_is_documented_with_its_type_and_labels():
    text = read(os.path.join(DOCS, "metrics.md"))
    rows = _metric_rows(text)
    documented = {name: (kind, labels) for name, kind, labels in rows}
    expected = {}
    for spec in metrics.METRICS:
        name = spec.name + "_total" if spec.kind == "counter" else spec.name
        expected[name] = (spec.kind, tuple(spec.labels))
    assert documented == expected, "docs/metrics.md's table differs from orchestrator/metrics.py"
    assert rows[0][0] == "islands_goodput_ratio", "goodput comes first"
    # Every islands_* name the module spells out, family or sample, appears in the page.
    source_names = set(re.findall(r"[\"'](islands_[a-z0-9_]+)[\"']", inspect.getsource(metrics)))
    assert source_names >= {spec.name for spec in metrics.METRICS}
    missing = sorted(n for n in source_names | set(metrics.sample_names()) if n not in text
                     and not n.endswith(("_bucket", "_sum", "_count")))
    assert not missing, f"metric names missing from docs/metrics.md: {missing}"


def test_every_label_value_is_documented():
    text = read(os.path.join(DOCS, "metrics.md"))
    values = (metrics.LEARNER_STATES + metrics.RECOVERY_PHASES + metrics.RESTART_REASONS
              + metrics.TOKEN_FATES + REJECT_REASONS + ("run", "up", "down"))
    missing = sorted({v for v in values if f"`{v}`" not in text})
    assert not missing, f"label values missing from docs/metrics.md: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, REPO))
def test_no_reference_to_internal_material(path):
    found = forbidden_in(read(path))
    assert not found, f"{os.path.relpath(path, REPO)} refers users to {found}"


# -- links -------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")  # Θ[p](v_base) in code is not a link


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", read(path)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slug_matches_github():
    assert _slug("`syncer.outer_optimizer`") == "syncerouter_optimizer"
    assert _slug("Quorum-floor pause") == "quorum-floor-pause"
    assert _slug("Drift, compression and error feedback") == "drift-compression-and-error-feedback"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_resolves(path):
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", FENCE.sub("", read(path)))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
            if file_part else path
        if not os.path.exists(resolved):
            broken.append(f"{target} (no file {os.path.relpath(resolved, REPO)})")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{os.path.relpath(path, REPO)}: broken links {broken}"


def test_the_index_links_every_page():
    index = read(os.path.join(DOCS, "README.md"))
    pages = sorted(os.path.basename(p) for p in MARKDOWN if os.path.dirname(p) == DOCS)
    missing = [p for p in pages if p != "README.md" and f"]({p})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_readme_points_to_every_page():
    text = read(os.path.join(REPO, "README.md"))
    assert "## Documentation" in text
    for page in PAGES:
        assert f"(docs/{page})" in text, page
    assert "islands config check FILE" in text


# -- the CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def run_cli(capsys):
    """Calls ``islands`` in-process; returns (exit code, stdout, stderr). The environment is put
    back afterwards (main sets Ray's loopback variables for the commands that connect)."""
    saved = dict(os.environ)

    def run(argv):
        try:
            rc = cli.main(list(argv))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out = capsys.readouterr()
        return rc, out.out, out.err

    yield run
    os.environ.clear()
    os.environ.update(saved)


def _choices(help_text: str) -> list[str]:
    """The subcommands an argparse help text offers: the ``{a,b,c}`` line that opens its
    positional arguments (an option's choices, ``--log-format {text,json}``, are not commands)."""
    for line in help_text.splitlines():
        m = re.match(r"^  \{([a-z0-9_,-]+)\}", line)
        if m:
            return m.group(1).split(",")
    return []


def _all_help(run_cli) -> dict[tuple[str, ...], str]:
    texts, todo = {}, [()]
    while todo:
        command = todo.pop(0)
        assert len(command) <= 3, f"runaway subcommand discovery: {command}"
        rc, out, err = run_cli([*command, "--help"])
        assert rc == 0, f"islands {' '.join(command)} --help exited {rc}: {err}"
        texts[command] = out
        if command[:1] != ("simulate",):  # its options pass through to the simulator as they are
            todo += [(*command, sub) for sub in _choices(out)]
    return texts


def test_cli_help_has_no_internal_references(run_cli):
    texts = _all_help(run_cli)
    assert {("run",), ("chaos", "kill"), ("config", "check"), ("simulate",)} <= set(texts)
    checked = texts
    bad = {" ".join(("islands",) + c): forbidden_in(t) for c, t in checked.items()
           if forbidden_in(t)}
    assert not bad, f"--help texts that refer users to internal material: {bad}"
    assert "docs/README.md" in texts[()]
    assert "docs/config.md" in texts[("config",)]


def test_config_schema_prints_json(run_cli):
    rc, out, err = run_cli(["config", "schema"])
    assert rc == 0, err
    schema = json.loads(out)
    assert "properties" in schema and "quorum" in schema["properties"]
    assert schema == json.loads(json.dumps(JobConfig.model_json_schema()))


def test_config_check_prints_the_resolved_config(run_cli):
    rc, out, err = run_cli(["config", "check", EXAMPLE])
    assert rc == 0, err
    resolved = yaml.safe_load(out)
    assert set(resolved) == set(JobConfig.model_fields)          # every default filled in
    assert resolved["health"]["restart"]["backoff_multiplier"] == 2.0   # a default local.yaml omits
    assert JobConfig.model_validate(resolved) == load_config(EXAMPLE)


def test_config_check_refuses_a_bad_file_naming_the_field(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("quorum: {min_learners: 5}\nregions:\n  us-east: {learners: 4}\n")
    rc, out, err = run_cli(["config", "check", str(bad)])
    assert rc == 2 and out == ""
    assert err.startswith(f"islands: invalid config {bad}:")
    assert "quorum.min_learners: quorum (5) exceeds learners (4)" in err

    rc, out, err = run_cli(["config", "check", str(tmp_path / "absent.yaml")])
    assert rc == 2 and out == "" and "islands: invalid config" in err


def test_config_commands_do_not_import_ray():
    code = ("import sys; from islands.orchestrator.cli import main; "
            f"rc = main(['config', 'check', {EXAMPLE!r}]); rc2 = main(['config', 'schema']); "
            "sys.exit(10 if 'ray' in sys.modules else rc or rc2)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, (f"exit {proc.returncode} (10: Ray was imported)\n"
                                  f"{proc.stderr[-2000:]}")


# -- CI ------------------------------------------------------------------------------------------
_FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python in .ci/run: records each command; pytest exits as the test says.
echo "$*" >> "$CI_LOG"
case "$*" in
  *"pytest -q -m slow tests"*) exit "$SLOW_RC" ;;
  *"pytest -q tests"*) exit "$FAST_RC" ;;
esac
exit 0
"""


@pytest.mark.parametrize("fast_rc,slow_rc,ci_rc", [(0, 0, 0), (0, 5, 0), (0, 1, 1), (1, 0, 1)])
def test_ci_runs_the_readme_test_command_then_the_slow_tests(tmp_path, fast_rc, slow_rc, ci_rc):
    """.ci/run, with python (and apt-get) stood in for: it lints, runs the README's test command,
    then the slow tests; a failing slow test fails it, no slow test collected (exit 5) does not."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", _FAKE_PYTHON), ("apt-get", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "ci.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "CI_LOG": str(log), "FAST_RC": str(fast_rc), "SLOW_RC": str(slow_rc)}
    proc = subprocess.run(["bash", os.path.join(REPO, ".ci", "run")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == ci_rc, proc.stderr
    readme = read(os.path.join(REPO, "README.md"))
    assert "python -m pytest -q tests\n" in readme
    assert "`python -m pytest -q -m slow tests`" in readme
    ran = log.read_text().splitlines()
    expected = ["-m ruff check .", "-m pytest -q tests", "-m pytest -q -m slow tests"]
    assert [c for c in ran if "ruff" in c or "pytest" in c] == expected[:2 if fast_rc else 3]
