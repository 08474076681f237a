"""`make docs-check` (docs/check_pages.py): pages rendered in headless Chromium at 1280 px, a table that does
not fit its column reported. Checked on small pages written here (one table clipped by a scrolling wrapper,
as furo wraps tables, one spilling out unclipped, one that fits) and, when the site is built, on its pages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_pages", ROOT / "docs" / "check_pages.py")
check_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_pages)

BROWSER = check_pages._browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="needs Chromium (apt-get install chromium)")

CELL = "<td><code>{}</code></td>"


def _page(path: Path, tables: str) -> Path:
    path.write_text(f"""<!doctype html><html><head><style>
article {{ width: 600px; margin-left: 100px; }}
.wrap {{ overflow-x: auto; }}
code {{ white-space: nowrap; }}
</style></head><body><article>{tables}</article></body></html>""")
    return path


def test_a_table_cut_off_by_its_scrolling_wrapper_or_spilling_out_is_reported_and_one_that_fits_is_not(tmp_path):
    """At 1280 px: a 900 px table in an overflow-x wrapper (the clipped coming-from table's case) and one
    outside any wrapper are reported with their widths; a table of short cells is not."""
    wide = "<table><tr>" + CELL.format("x" * 90) + "</tr></table>"
    fits = "<table><tr>" + CELL.format("short") + "</tr></table>"
    page = _page(tmp_path / "page.html", f'<div class="wrap">{wide}</div>{fits}{wide}')
    found = check_pages.overflowing_tables(BROWSER, page)
    assert [t["table"] for t in found] == [1, 3]
    assert all(t["width"] > 600 and t["column"] == 600 for t in found)
    assert check_pages.overflowing_tables(BROWSER, _page(tmp_path / "fine.html", fits)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fine.html", "page.html"]  # the probe copies are gone


SITE = ROOT / "docs" / "_build" / "html"


@pytest.mark.skipif(not (SITE / "coming-from.html").exists(), reason="the site is not built (make docs)")
def test_the_built_sites_coming_from_table_fits_at_1280_px():
    """The first page a Lightning user opens: its comparison table shows its deepepochs column whole."""
    assert check_pages.overflowing_tables(BROWSER, SITE / "coming-from.html") == []
