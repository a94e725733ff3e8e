"""Every command the docs show exists, and the cheap ones run (no Ray).

The shell blocks (```bash, ```sh, ```shell) of README.md and docs/*.md are read line by line
(backslash continuations joined). Every ``islands`` command in them, at the start of a line, after
``&&`` / ``;`` / ``|``, or after the ``--`` of ``ray job submit … --`` or ``kubectl exec … --``,
is parsed by the CLI's own argparse parser: its subcommand and every flag must exist and its
arguments must parse. Then:

- the cheap ones run for real, in-process: ``--help``, ``islands config schema`` and
  ``islands config check FILE`` of a file in the repository;
- any other is marked in the doc source with the reason it is not run: an HTML comment
  ``<!-- not run: REASON -->`` on the line above the block (the whole block), or a trailing
  ``# long: REASON`` on the line. Those are reported as skipped with their reason
  (``pytest -rs`` lists them); an unmarked one fails, naming the page and line.

Every ```yaml block is a JobConfig or a part of one, unless the line above it says
``<!-- not a job config: REASON -->``. The rule for a part: its top-level keys are JobConfig keys;
a snippet without ``regions`` is checked on top of one region of one learner. Each is checked
with ``islands config check``, as is every example under deploy/examples/.

``pip install`` lines name extras that pyproject.toml defines, and ``python PATH.py`` names a
script that exists.
"""

import argparse
import contextlib
import dataclasses
import glob
import io
import os
import re
import shlex
import sys
from typing import Optional
from unittest import mock

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

from islands.orchestrator import cli
from islands.orchestrator.config import JobConfig
from islands.studies import simulate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "deploy", "examples", "*.yaml")))
SHELL = {"bash", "sh", "shell", "console"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.+?)\s*-->\s*$")
NOT_CONFIG = re.compile(r"^\s*<!--\s*not a job config:\s*(.+?)\s*-->\s*$")
LONG = re.compile(r"#\s*(?:long|not run):\s*(.+)$")
SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
REDIRECTS = {">", ">>", "<", "2>", "<("}
BASE_REGIONS = {"local": {"learners": 1}}


@dataclasses.dataclass
class Block:
    page: str          # relative to the repository
    line: int          # the first line inside the fence, 1-based
    lang: str
    lines: list        # (line number, text)
    marker: Optional[str]   # the reason of the HTML comment above the fence, if any


def blocks(path: str) -> list:
    """The fenced blocks of a Markdown page, with the HTML comment marker above each."""
    text = open(path, encoding="utf-8").read().splitlines()
    rel = os.path.relpath(path, REPO)
    out, i = [], 0
    while i < len(text):
        m = re.match(r"^(\s*)```\s*([\w-]*)", text[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(text) and not re.match(r"^\s*```\s*$", text[j]):
            j += 1
        body = [(n + 1, line[len(indent):] if line.startswith(indent) else line.lstrip())
                for n, line in enumerate(text[start + 1:j], start + 1)]
        above = next((text[k] for k in range(start - 1, -1, -1) if text[k].strip()), "")
        marker = None
        for pattern in (NOT_RUN, NOT_CONFIG):
            hit = pattern.match(above)
            if hit:
                marker = hit.group(1)
        out.append(Block(rel, start + 2, lang, body, marker))
        i = j + 1
    return out


# -- the shell commands --------------------------------------------------------------------------
@dataclasses.dataclass
class Command:
    where: str          # page:line
    argv: list          # after "islands"
    reason: Optional[str]    # why it is not run (the doc's marker), if marked
    error: Optional[str] = None


def logical_lines(block: Block):
    """(line number, text) with backslash continuations joined."""
    pending, first = "", None
    for number, text in block.lines:
        if first is None:
            first = number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        yield first, pending + text
        pending, first = "", None
    if pending:
        yield first, pending


def segments(line: str) -> list:
    """The simple commands of one shell line: split on && ; | and friends, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    out, current = [], []
    for token in tokens:
        if token in SEPARATORS or token in ("(", ")", "$("):
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return [s for s in out if s]


def islands_argv(segment: list) -> Optional[list]:
    """The arguments of an ``islands`` command in a simple command, or None."""
    words = list(segment)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):      # VAR=value islands ...
        words.pop(0)
    if words[:1] == ["islands"]:
        words = words[1:]
    elif "--" in words and words[words.index("--") + 1:][:1] == ["islands"]:
        words = words[words.index("--") + 2:]                 # ray job submit ... -- islands ...
    else:
        return None
    # A redirection ends the arguments.
    for k, word in enumerate(words):
        if word in REDIRECTS or re.match(r"^\d?>", word):
            return words[:k]
    return words


def shell_commands() -> list:
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in SHELL:
                continue
            for number, line in logical_lines(block):
                where = f"{block.page}:{number}"
                long = LONG.search(line)
                reason = block.marker or (long.group(1).strip() if long else None)
                try:
                    parts = segments(line)
                except ValueError as exc:
                    if "islands" in line:
                        found.append(Command(where, [], reason, f"cannot split {line!r}: {exc}"))
                    continue
                for part in parts:
                    argv = islands_argv(part)
                    if argv is not None:
                        found.append(Command(where, argv, reason))
    return found


def pip_and_scripts() -> list:
    """(where, kind, value): extras of ``pip install``, scripts of ``python PATH.py``."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in SHELL:
                continue
            for number, line in logical_lines(block):
                try:
                    parts = segments(line)
                except ValueError:
                    continue
                for part in parts:
                    where = f"{block.page}:{number}"
                    if part[:2] == ["pip", "install"]:
                        for word in part[2:]:
                            m = re.match(r"^(?:\.|islands)\[([\w,-]+)\]$", word)
                            if m:
                                found += [(where, "extra", e) for e in m.group(1).split(",")]
                    if part[:1] in (["python"], ["python3"]) and len(part) > 1 \
                            and part[1].endswith(".py") and not part[1].startswith("/"):
                        found.append((where, "script", part[1]))
    return found


_PARSER = {}


class _Grabbed(Exception):
    pass


def islands_parser() -> argparse.ArgumentParser:
    """The parser ``islands`` runs with. cli.main builds it inline, so it is taken from the
    parse_args call main makes (nothing else of main runs)."""
    if "islands" in _PARSER:
        return _PARSER["islands"]
    build = getattr(cli, "build_parser", None)
    if build is not None:
        _PARSER["islands"] = build()
        return _PARSER["islands"]
    grabbed = {}

    def grab(self, args=None, namespace=None):
        grabbed["parser"] = self
        raise _Grabbed

    saved = dict(os.environ)
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
            cli.main(["status"])
    except _Grabbed:
        pass
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert "parser" in grabbed, "could not find the parser islands builds (orchestrator/cli.py)"
    _PARSER["islands"] = grabbed["parser"]
    return _PARSER["islands"]


def simulate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="islands simulate")
    simulate.add_arguments(parser)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(argv: list):
    """(the parser of the innermost subcommand, the subcommand path, the rest) or an error."""
    parser, path, rest = islands_parser(), [], list(argv)
    while True:
        choices = subcommands(parser)
        if not choices or not rest or rest[0].startswith("-"):
            break
        word = rest.pop(0)
        if word not in choices:
            raise LookupError(f"`islands {' '.join(path + [word])}`: no such command "
                              f"({' '.join(['islands'] + path)} has {sorted(choices)})")
        path.append(word)
        parser = simulate_parser() if path == ["simulate"] else choices[word]
    if subcommands(parser) and not {"-h", "--help"} & set(rest):
        raise LookupError(f"`islands {' '.join(path)}` needs a subcommand: "
                          f"{sorted(subcommands(parser))}")
    return parser, path, rest


def check_exists(argv: list) -> tuple:
    """Raises LookupError naming what does not exist; returns (path, rest)."""
    parser, path, rest = resolve(argv)
    known = parser._option_string_actions
    for word in rest:
        if word.startswith("-") and not re.match(r"^-\d", word) and word != "-":
            flag = word.split("=", 1)[0]
            if flag not in known:
                raise LookupError(f"`islands {' '.join(path)}` has no flag {flag} "
                                  f"(it has {sorted(k for k in known if k.startswith('--'))})")
    if not {"-h", "--help"} & set(rest):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(rest)
        except SystemExit:
            raise LookupError(f"`islands {' '.join(argv)}` does not parse: "
                              f"{err.getvalue().strip().splitlines()[-1]}") from None
    return path, rest


def run_islands(argv: list, capsys) -> tuple:
    """Runs ``islands ARGV`` in-process; the environment main sets is put back."""
    saved = dict(os.environ)
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr()
    return rc, out.out, out.err


def cheap(path: list, rest: list) -> Optional[str]:
    """Why a command may run in a test ('help', 'schema', 'check'), or None."""
    if {"-h", "--help"} & set(rest):
        return "help"
    if path == ["config", "schema"]:
        return "schema"
    if path == ["config", "check"]:
        return "check"
    return None


COMMANDS = shell_commands()


def test_the_docs_show_commands():
    """The collector finds what it should: a guard against a parser that finds nothing."""
    pages = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/operations.md"} <= pages, pages
    assert any(c.argv[:2] == ["config", "check"] for c in COMMANDS)
    assert any(c.argv[:1] == ["run"] for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS,
                         ids=lambda c: f"{c.where} islands {' '.join(c.argv)}"[:120])
def test_every_command_in_the_docs_exists(command, capsys):
    where = command.where
    if command.error:
        pytest.fail(f"{where}: {command.error}")
    try:
        path, rest = check_exists(command.argv)
    except LookupError as exc:
        pytest.fail(f"{where}: {exc}")
    kind = cheap(path, rest)
    if kind == "check":
        target = rest[0]
        file = os.path.join(REPO, target)
        if not os.path.isfile(file):
            if command.reason:
                pytest.skip(f"{where}: not run ({command.reason})")
            pytest.fail(f"{where}: `islands config check {target}`: no such file in the "
                        f"repository; mark the line `# long: REASON` if it is made by an "
                        f"earlier step")
        rest = [file]
    if kind is not None:
        rc, out, err = run_islands([*path, *rest], capsys)
        assert rc == 0, f"{where}: `islands {' '.join(command.argv)}` exited {rc}: {err[-2000:]}"
        assert out.strip(), f"{where}: `islands {' '.join(command.argv)}` printed nothing"
        return
    if command.reason:
        pytest.skip(f"{where}: `islands {' '.join(command.argv)}` not run: {command.reason}")
    pytest.fail(f"{where}: `islands {' '.join(command.argv)}` is not cheap to run (only --help, "
                f"config schema and config check are): mark its block with "
                f"`<!-- not run: REASON -->` above the fence, or the line with `# long: REASON`")


def test_every_subcommand_the_docs_show_has_help(capsys):
    shown = set()
    for command in COMMANDS:
        try:
            path, _ = check_exists(command.argv)
        except LookupError:
            continue   # reported by test_every_command_in_the_docs_exists
        shown.add(tuple(path))
    assert shown
    for path in sorted(shown):
        rc, out, err = run_islands([*path, "--help"], capsys)
        assert rc == 0 and "usage:" in out, f"islands {' '.join(path)} --help: {rc} {err}"


def test_config_schema_runs(capsys):
    rc, out, err = run_islands(["config", "schema"], capsys)
    assert rc == 0 and '"properties"' in out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_example_passes_config_check(path, capsys):
    rc, out, err = run_islands(["config", "check", path], capsys)
    assert rc == 0, f"islands config check {os.path.relpath(path, REPO)}: {err}"
    assert yaml.safe_load(out)["regions"]


# -- pip extras and scripts ----------------------------------------------------------------------
def _extras() -> set:
    text = open(os.path.join(REPO, "pyproject.toml"), "rb").read()
    if tomllib is not None:
        return set(tomllib.loads(text.decode())["project"]["optional-dependencies"])
    return set(re.findall(r"^(\w+) = \[", text.decode(), re.MULTILINE))  # pragma: no cover


@pytest.mark.parametrize("item", pip_and_scripts(), ids=lambda i: f"{i[0]} {i[2]}")
def test_every_extra_and_script_in_the_docs_exists(item):
    where, kind, value = item
    if kind == "extra":
        assert value in _extras(), f"{where}: pip extra [{value}] is not in pyproject.toml"
    else:
        assert os.path.isfile(os.path.join(REPO, value)), f"{where}: no script {value}"


# -- the YAML snippets ---------------------------------------------------------------------------
def yaml_snippets() -> list:
    return [b for page in PAGES for b in blocks(page) if b.lang in ("yaml", "yml")]


@pytest.mark.parametrize("block", yaml_snippets(), ids=lambda b: f"{b.page}:{b.line}")
def test_every_yaml_snippet_validates(block, capsys, tmp_path):
    where = f"{block.page}:{block.line}"
    text = "\n".join(line for _, line in block.lines)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        pytest.fail(f"{where}: not YAML: {exc}")
    if block.marker:
        pytest.skip(f"{where}: not a job config: {block.marker}")
    assert isinstance(data, dict), f"{where}: a job config snippet is a mapping"
    unknown = sorted(set(data) - set(JobConfig.model_fields))
    assert not unknown, (f"{where}: {unknown} are not JobConfig keys; if the snippet is not a job "
                         f"config, say so above it: `<!-- not a job config: REASON -->`")
    config = dict(data)
    config.setdefault("regions", BASE_REGIONS)
    file = tmp_path / "snippet.yaml"
    file.write_text(yaml.safe_dump(config))
    rc, out, err = run_islands(["config", "check", str(file)], capsys)
    assert rc == 0, f"{where}: the snippet does not validate:\n{err}"


@pytest.mark.parametrize("name", ["gpu.yaml", "tpu.yaml"])
def test_the_accelerator_examples_pass_the_checks_islands_run_makes(name):
    """What `islands run` checks before Ray: the model builds and a batch fits the corpus."""
    from islands.orchestrator.config import load_config
    from islands.orchestrator.preflight import preflight

    config = load_config(os.path.join(REPO, "deploy", "examples", name))
    kinds = {region.accelerator for region in config.regions.values()}
    assert kinds == {name.split(".")[0]}, kinds
    preflight(config)
