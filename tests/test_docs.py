"""The documents a newcomer reads: README.md fits a few screens and starts with the two commands, every repository
path that README.md and docs/*.md name exists, every document the code cites exists, and every measured figure in
docs/results.md is a row with its command, date, commit and machine."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The repository's top-level folders: a word starting with one of these and a slash is a path into the repository.
TOP = ("configs", "maxctx", "scripts", "tests", "docs", "docker", "deploy", "constraints")
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w.*/-]*)" % "|".join(TOP))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _exists(path: str) -> bool:
  path = path.rstrip("./")
  return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
  # Protects the reader from a document that cites a file that is not there (design.md was cited four times and
  # absent) or a path that moved: markdown links, and every word that starts with a top-level folder, in prose,
  # backticks and code blocks alike. Placeholders (<recipe>) end the path before them.
  text = re.sub(r"<!--.*?-->", "", page.read_text(), flags=re.S)   # notes to maintainers, not shown to readers
  missing = []
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue
    if not (page.parent / target.split("#")[0]).exists():
      missing.append(target)
  missing += [p for p in PATH.findall(text) if not _exists(p)]
  assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


def test_every_document_the_code_cites_exists():
  # A docstring or comment that sends the reader to `design.md` (or any other .md) needs that page, at the top level
  # or under docs/. Names the code writes itself ("plan.md", "eval.md", "results.md": a tool's outputs) are outputs,
  # not citations.
  sources = [p for d in ("maxctx", "tests", "scripts", "configs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".yml", ".sh") and p.is_file()]
  cited, written = set(), set()
  for path in sources:
    text = path.read_text()
    cited |= set(re.findall(r"\b([\w-]+\.md)\b", text))
    written |= set(re.findall(r"[\"']([\w-]+\.md)[\"']", text))
  missing = sorted(n for n in cited - written if not (ROOT / n).exists() and not (ROOT / "docs" / n).exists())
  assert not missing, f"the code cites documents that do not exist: {missing}"


def test_readme_fits_a_few_screens_and_starts_with_the_two_commands():
  lines = README.read_text().splitlines()
  assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ (at most 250)"
  head = "\n".join(lines[:30])
  assert re.search(r"^make train\b", head, re.M) and re.search(r"^make test\b", head, re.M), \
      "README.md's first 30 lines must show `make train` and `make test`"
  # The status table: what has run where, one column per kind of evidence.
  assert re.search(r"^\| capability \| tested on CPU here \| compiled for TPU ahead of time \| run on a TPU \| "
                   r"run on a GPU \|$", "\n".join(lines), re.M), "README.md lost its status table"


def _result_rows() -> list[list[str]]:
  rows, header = [], None
  for line in (ROOT / "docs" / "results.md").read_text().splitlines():
    if not line.startswith("|"):
      header = None
      continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if header is None:
      header = cells
      assert header == ["what", "value", "command", "date", "commit", "machine"], header
    elif not set(line) <= set("|- "):
      assert len(cells) == 6, line
      rows.append(cells)
  return rows


def test_every_figure_in_results_is_a_row_with_its_command_date_commit_and_machine():
  rows = _result_rows()
  assert rows
  for what, value, command, date, commit, machine in rows:
    assert what and value and command and machine, (what, value)
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), (what, date)
    assert re.fullmatch(r"[0-9a-f]{7,40}", commit), (what, commit)
  # Each commit is one of the repository's, where the history is at hand (not in an sdist or a shallow export).
  if shutil.which("git") and (ROOT / ".git").exists() and subprocess.run(
      ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True).stdout.strip() == "false":
    commits = sorted({r[4] for r in rows})
    out = subprocess.run(["git", "cat-file", "--batch-check"], input="".join(f"{c}^{{commit}}\n" for c in commits),
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    unknown = [c for c, line in zip(commits, out.splitlines()) if line.endswith("missing")]
    assert not unknown, f"docs/results.md names commits this repository does not have: {unknown}"
