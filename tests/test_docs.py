"""README.md and docs/*.md in, their promises checked: rendered tables equal their committed results,
the README stays a front door, no internal references, every relative link resolves."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# Markdown links and images: [text](target) / ![alt](target); autolinks and bare URLs are not relative.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A commit hash as a word of 7-40 hex digits with a letter and a digit in it; hex inside a file
# name or a version string (mobilenet_v2-b0353104.pth, 2.5.0a0+872d972e41) is not one.
COMMIT = re.compile(r"(?<![\w./+-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w+]|\.\w)")
INTERNAL = [
    ("an issue number", re.compile(r"\bissues?\s*#\d+|#\d+\b", re.I)),
    ("a DESIGN.md section", re.compile(r"\bDESIGN(?:\.md)?\s+(?:section\s+)?\d")),
    ("a STYLE.md section", re.compile(r"\bSTYLE(?:\.md)?\s+(?:section\s+)?\d")),
    ("a commit hash", COMMIT),
]


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """The text without fenced code blocks (shell lines may hold anything a shell does)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", _prose(path.read_text()), re.M)}


def test_rendered_tables_equal_their_committed_results(capsys):
    """`python scripts/render_docs.py --check`: every table between render markers is what its JSON renders."""
    code = _render_docs().main(["--check"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err


def test_render_check_fails_on_a_changed_figure(tmp_path, monkeypatch):
    """--check is not vacuous: one changed cell in a rendered block is found, and rendering restores it."""
    rd = _render_docs()
    (tmp_path / "docs").mkdir()
    text = README.read_text()
    block = re.search(r"<!-- render:results -->\n.*?<!-- /render -->", text, re.S).group(0)
    assert "| 414.6 |" in block
    (tmp_path / "README.md").write_text(text.replace(block, block.replace("| 414.6 |", "| 41.46 |", 1)))
    assert list(rd.stale(tmp_path)) == [tmp_path / "README.md"]
    cache: dict[str, str] = {}
    assert rd.render_text((tmp_path / "README.md").read_text(), cache) == text


def test_every_render_block_has_a_known_name_and_every_renderer_is_used():
    rd = _render_docs()
    used = {m.group("name") for p in DOCS for m in rd.BLOCK.finditer(p.read_text())}
    assert used <= set(rd.RENDERERS), used - set(rd.RENDERERS)
    assert used == set(rd.RENDERERS), set(rd.RENDERERS) - used
    for path in DOCS:  # every opening marker is closed
        text = path.read_text()
        assert text.count("<!-- render:") == text.count("<!-- /render -->"), path


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    text = README.read_text()
    for heading in ("## Your own data on a Jetson, step by step", "## Tested on", "## Results"):
        assert heading in text
    assert re.search(r"## Tested on\n+<!-- render:tested-on -->\n.*?<!-- /render -->", text, re.S)
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_references(path):
    """Users have no issue tracker numbers, design-document sections or commit hashes to follow."""
    text = path.read_text()
    for what, pattern in INTERNAL:
        found = [m.group(0) for m in pattern.finditer(text)]
        assert not found, f"{path.relative_to(ROOT)} mentions {what}: {found[:5]}"


def test_commit_pattern_catches_hashes_and_spares_file_names():
    assert COMMIT.search("measured at commit 61ac20b.") and COMMIT.search("(4cd2d28fb4a73287bb80630001cba2bf7b527b20)")
    assert COMMIT.search("at commits 288ba05-ad24840 (every masked backward")
    assert not COMMIT.search("`mobilenet_v2-b0353104.pth`") and not COMMIT.search("torch 2.5.0a0+872d972e41")
    assert not COMMIT.search("3,911,468 B and 1234567 bytes") and not COMMIT.search("defaced")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    """Every relative link points to a file or folder in the repository, and its #anchor to a heading."""
    broken = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)
