"""The repository's own rules, checked by reading its files (no process starts).

Data flows one way. A test asks the harness to run a rank function; the harness never
imports a tutorial module; tutorial code never imports the harness, because a learner copies
tutorial code into a script of their own, where ``tutorial_impl.testing`` does not exist. The
one exception is a demo's ``main``, which may import the CLI's launcher (``tutorial_impl.cli``,
built on the harness) inside its own body. And a lesson reads in one file: rank functions that
exist only for a test live in that test module, so no test imports a ``*_checks`` module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tutorial_impl"
TUTORIALS = sorted(p for d in ("dist_tuto", "rpc", "ddp") for p in (PACKAGE / d).glob("*.py"))
HARNESS = sorted((PACKAGE / "testing").rglob("*.py"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def imports(path: Path, skip_functions: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, except inside the named functions."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and child.name in skip_functions:
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append((child.lineno, child.module))
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_there_are_tutorial_and_harness_modules_to_check():
    assert len(TUTORIALS) >= 12 and len(HARNESS) >= 6  # a moved folder must not pass vacuously


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tutorial_code_never_imports_the_harness(path):
    """Outside a demo's ``main``, no tutorial module imports the harness or the CLI."""
    bad = [
        f"line {line}: {module}"
        for line, module in imports(path, skip_functions=("main",))
        if module.startswith(("tutorial_impl.testing", "tutorial_impl.cli"))
    ]
    assert not bad, f"{path.relative_to(REPO)} imports the harness: {bad}"


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: str(p.relative_to(PACKAGE / "testing")))
def test_the_harness_never_imports_a_tutorial(path):
    prefixes = ("tutorial_impl.dist_tuto", "tutorial_impl.rpc", "tutorial_impl.bench")
    bad = [f"line {line}: {m}" for line, m in imports(path) if m.startswith(prefixes)]
    assert not bad, f"{path.relative_to(REPO)} imports tutorial code: {bad}"


def test_no_test_imports_rank_functions_from_a_helpers_module():
    """A lesson reads in one file: its rank functions sit above the tests that run them."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, module in imports(path):
            last = module.rsplit(".", 1)[-1]
            if last.endswith("_checks") or last == "selftest_ranks":
                bad.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not bad, bad


def module_aliases(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, alias) of every module of this package that ``path`` imports under
    another name (``from tutorial_impl.a import b as c``, ``import tutorial_impl.a.b as c``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tutorial_impl"):
            pairs = [(f"{node.module}.{a.name}", a.asname) for a in node.names]
        elif isinstance(node, ast.Import):
            pairs = [(a.name, a.asname) for a in node.names if a.name.startswith("tutorial_impl")]
        else:
            continue
        for module, alias in pairs:
            where = REPO / Path(*module.split("."))
            if alias and (where.with_suffix(".py").is_file() or where.is_dir()):
                found.append((node.lineno, module, alias))
    return found


def test_no_module_is_imported_under_the_name_of_another():
    """A reader who meets ``runner.run`` looks for ``runner.py``: a module imported under
    another name takes the name of its own package, or a name no module of the tree has
    (``stacks as forensics`` and ``protocol as runner`` named modules since renamed, and
    ``__main__ as cli`` one that exists beside it)."""
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*/")}
    bad, seen = [], 0
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py")]):
        for line, module, alias in module_aliases(path):
            seen += 1
            if alias in names and alias not in module.split("."):
                bad.append(f"{path.relative_to(REPO)}:{line}: {module} as {alias}")
    assert not bad, bad
    assert seen >= 30  # the aliases were found (about 70 today): the rule did not pass vacuously


def test_the_docs_name_every_module_and_test_file():
    """The learning path must lead to every file a reader may need: README.md or a docs page
    names each one."""
    docs = "\n".join(path.read_text() for path in DOCS)
    files = [
        p
        for p in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("test_*.py")]
        if p.name not in ("__init__.py", "__main__.py")
    ]
    missing = sorted(str(p.relative_to(REPO)) for p in files if p.name not in docs)
    assert not missing, f"neither README.md nor docs/*.md names: {missing}"


def test_every_tests_path_named_in_code_and_docs_exists():
    """A comment or doc line that sends a learner to a test file must name a real one.
    (The README's ``tests/test_averaging.py`` is in the reader's own project, an example.)"""
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= {(path, m) for m in re.findall(r"tests/[\w/]*test_\w+\.py", path.read_text())}
    for path in DOCS:
        named |= {(path, m) for m in re.findall(r"tests/\w+/test_\w+\.py", path.read_text())}
    missing = sorted(f"{p.relative_to(REPO)}: {m}" for p, m in named if not (REPO / m).exists())
    assert not missing, missing


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """Markdown without its fenced code blocks and code spans, where nothing is a link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation removed, spaces to '-', repeats -1, -2."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links, images and link definitions that are not URLs."""
    text = prose(page.read_text())
    targets = [*LINK.findall(text), *REFERENCE.findall(text)]
    return [t for t in targets if not re.match(r"([a-z][a-z0-9+.-]*:|//)", t, re.I)]


def test_every_relative_link_in_the_docs_resolves():
    """Every link and image path in README.md and docs/*.md that points into the repository
    leads to a file or folder that exists, and an ``#anchor`` to a heading of that page."""
    broken, headings = [], {}
    for page in DOCS:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: {target}"
            if not resolved.is_relative_to(REPO):
                broken.append(f"{where} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md":
                if resolved not in headings:
                    headings[resolved] = anchors(resolved)
                if anchor not in headings[resolved]:
                    broken.append(f"{where} (no such heading)")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    """README.md is the way in: every page of docs/ is one link away from it."""
    linked = {(REPO / t.partition("#")[0]).resolve() for t in relative_links(REPO / "README.md")}
    assert linked, "README.md has no relative link at all: is the link pattern broken?"
    missing = sorted(p.name for p in DOCS[1:] if p.resolve() not in linked)
    assert not missing, f"README.md links no docs/ page named {missing}"


def test_the_link_checker_reads_links_and_anchors_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Warm worlds: `warm.py`, (opt-in)\n## GPU\n## GPU\n"
        "```bash\n# not a heading\n[not](a-link.md)\n```\n"
        'See [a `b`](x.md#warm-worlds-warmpy-opt-in "title"), ![i](../images/a.png), `[c](d.md)`\n'
        "[ref]: <docs/y.md#gpu-1>\n"
    )
    assert anchors(page) == {"warm-worlds-warmpy-opt-in", "gpu", "gpu-1"}
    text = prose(page.read_text())
    assert LINK.findall(text) == ["x.md#warm-worlds-warmpy-opt-in", "../images/a.png"]
    assert REFERENCE.findall(text) == ["docs/y.md#gpu-1"]


def test_the_readmes_test_count_is_true(request):
    """The README says how many tests the suite has; the collected count must agree (±10%).

    Only a run of the whole suite can tell (under ``pytest -n auto`` every worker collects
    every test), so a run of some files, or one filtered by -k/-m, skips this.
    """
    claimed = int(re.search(r"about (\d+) tests", (REPO / "README.md").read_text()).group(1))
    items = request.session.items
    files = {Path(item.path) for item in items}
    everything = set((REPO / "tests").rglob("test_*.py"))
    options = request.config.option
    if files != everything or options.keyword or options.markexpr:
        pytest.skip("the test count is checked only when the whole suite is collected")
    assert abs(len(items) - claimed) <= claimed / 10, (
        f"README.md says about {claimed} tests; the suite has {len(items)}: update the README"
    )
