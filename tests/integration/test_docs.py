"""The documentation site (mkdocs.yml, docs/) builds offline with `mkdocs build --strict`, and that build fails
on a broken link, a missing anchor and a page left out of the navigation."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.helpers import ROOT, Launch, run


def build(root: Path, site: Path) -> Launch:
    """`mkdocs build --strict` of the site at ``root`` (README.md beside mkdocs.yml: the support table's snippet)."""
    return run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml"),
                "--site-dir", str(site)], timeout=180, cwd=root, env={"NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly_and_offline(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0 and "WARNING" not in result.output, result.output[-4000:]
    pages = list((tmp_path / "site").rglob("*.html"))
    assert (tmp_path / "site" / "reference" / "options" / "index.html") in pages
    strategies = (tmp_path / "site" / "guides" / "strategies" / "index.html").read_text()
    assert "<td>full, LoRA</td>" in strategies  # the README's support table, included as a table
    fetched = [p for p in pages if "fonts.googleapis.com" in p.read_text() or "fonts.gstatic.com" in p.read_text()]
    assert not fetched, fetched  # theme font: false, nothing loaded from Google's font servers


def test_a_broken_link_a_missing_anchor_and_a_page_outside_the_nav_each_fail_it(tmp_path):
    site = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", site / "docs")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, site / name)
    data = site / "docs" / "guides" / "data.md"
    data.write_text(data.read_text() + "\n[a page](no-such-page.md) and [an anchor](packing.md#no-such-anchor)\n")
    (site / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    result = build(site, tmp_path / "site")
    assert result.returncode != 0, result.output[-4000:]
    for warning in ("contains a link 'no-such-page.md', but the target 'guides/no-such-page.md' is not found",
                    "contains a link 'packing.md#no-such-anchor', but the doc 'guides/packing.md' does not contain an "
                    "anchor '#no-such-anchor'",
                    "orphan.md"):
        assert warning in result.output, (warning, result.output[-4000:])
