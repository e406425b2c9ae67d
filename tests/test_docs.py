"""Docs promises: every figure has its producing command next to it; links resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def test_every_figure_has_a_producing_command():
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for number, line in enumerate(lines):
            for target in IMAGE.findall(line):
                following = "\n".join(lines[number + 1:number + 4])
                assert "produced by:" in following, f"{doc.name}:{number + 1} figure {target} has no producing command"
                assert (doc.parent / target).exists(), f"{doc.name}: figure {target} is missing"


def test_relative_links_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_troubleshooting_names_tests_that_exist():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name} does not exist"
    for name in re.findall(r"`::(\w+)`", text):
        assert any(f"def {name}(" in p.read_text() for p in (ROOT / "tests").glob("test_*.py")), name


def test_migration_page_names_every_no_effect_field_and_default_difference():
    from rlft.config import CONFIG_CLASSES
    from rlft.config.options import no_effect, refused

    text = (ROOT / "docs" / "migration.md").read_text()
    names = {name for cls in CONFIG_CLASSES for name in [*no_effect(cls), *refused(cls)]}
    for name in sorted(names):
        assert f"`{name}`" in text, name
    for name in ("bf16", "dtype", "max_prompt_length", "tf32"):  # the defaults that differ from TRL's
        assert f"`{name}`" in text, name


def test_docs_refer_to_nothing_outside_the_repository():
    """Links, and paths written in code spans, resolve inside the checkout: a user's has nothing else."""
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "/work/" not in text, f"{doc.name} points outside the repository"
        links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
        spans = [t for t in re.findall(r"`([^`\s]+)`", text) if t.startswith("../")]
        for target in links + spans:
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT.resolve()), f"{doc.name}: {target} is outside the repository"
