"""The documentation a user reads: the generated configuration reference matches the schema,
every relative link of the Markdown pages resolves (to a file, and to a heading where it names
one), and the citation file is valid CFF."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchtitan.config.job_config import JobConfig
from torchtitan.config.parsing import all_options
from torchtitan.config.reference import markdown

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md")])
REFERENCE = REPO / "docs" / "configuration.md"


def test_the_configuration_reference_is_generated_from_the_schema():
    text = REFERENCE.read_text()
    assert text == markdown(), ("docs/configuration.md is stale: run "
                                "python -m torchtitan.config.reference docs/configuration.md")
    for fields in all_options(JobConfig).values():
        for option in fields.values():
            assert f"**`{option.key}`**" in text, option.key
    for key in JobConfig.REMOVED_OPTIONS:
        assert f"**`{key}`**" in text, key


def test_the_reference_command_finds_a_stale_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(REFERENCE.read_text().replace("training.steps", "training.stepz"))
    cmd = [sys.executable, "-m", "torchtitan.config.reference"]
    r = subprocess.run([*cmd, "--check", str(stale)], capture_output=True, text=True)
    assert r.returncode == 1 and "stale" in r.stderr
    assert subprocess.run([*cmd, str(stale)]).returncode == 0
    assert subprocess.run([*cmd, "--check", str(stale)]).returncode == 0
    assert stale.read_text() == REFERENCE.read_text()


# ------------------------------------------------------------------------------- links

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but hyphens and underscores
    dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    out, seen = set(), {}
    for line in text.splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[tuple[int, str]]:
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for m in _LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.append((number, target))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for line, target in relative_links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{page.relative_to(REPO)}:{line}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{page.relative_to(REPO)}:{line}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## The `b` part\nsee [b](b.md), [part](#the-b-part), "
                                   "[gone](#nowhere) and ![pic](c.png)\n```\n[x](y.md)\n```\n")
    (tmp_path / "b.md").write_text("b\n")
    links = [t for _, t in relative_links(tmp_path / "a.md")]
    assert links == ["b.md", "#the-b-part", "#nowhere", "c.png"]
    assert anchors(tmp_path / "a.md") == {"top", "the-b-part"}


# ------------------------------------------------------------------------------- citation


def test_the_citation_file_is_valid_cff_and_matches_the_package():
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert {"message", "title", "authors", "license", "version"} <= set(cff)
    assert all("name" in a or "family-names" in a for a in cff["authors"])
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert cff["version"] == project["version"] and cff["license"] == project["license"]
    assert (REPO / "LICENSE").read_text().startswith("BSD 3-Clause License")
