"""Render every page of the built documentation site in headless Chromium and fail on a table that does
not fit its page (`make docs-check`, after `make docs`).

Each page is opened at a desktop width (1280 px by default) from a copy with a small script added: once the
page has loaded, the script measures every table against the page's content column and writes what
overflows into the document, which Chromium's `--dump-dom` prints. A table overflows when the box that
clips it (furo's scrolling table wrapper) holds more than it shows, or, unclipped, when it runs past the
content column's right edge: its last column is then cut off or behind a sideways scroll that a 1280 px
screen shows no sign of.

    python docs/check_pages.py [SITE] [--width 1280] [--screenshot OUT_DIR PAGE ...]

`--screenshot` also saves a PNG of the pages named (paths inside the site, e.g. `coming-from.html`).
Exit status: 0 when every table fits, 1 when one does not (each listed), 2 when Chromium is missing.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["check_site", "main", "overflowing_tables"]

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
#: Chromium's command-line names, in the order they are looked for.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags for a quiet, isolated, offline render (no sandbox: CI containers run as root).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")
_MARK = "data-table-overflow"
# Run when the page has loaded (styles and fonts applied): every table against the content column.
_PROBE = """<script>
window.addEventListener('load', function () {
  var column = (document.querySelector('article') || document.body).getBoundingClientRect();
  var found = [];
  document.querySelectorAll('table').forEach(function (table, i) {
    var box = table.getBoundingClientRect();
    var clip = table.parentElement;  // the nearest box that clips or scrolls sideways (furo's table wrapper)
    while (clip && clip !== document.body && getComputedStyle(clip).overflowX === 'visible') {
      clip = clip.parentElement;
    }
    var hidden = clip && clip !== document.body ? clip.scrollWidth > clip.clientWidth + 1
                                                : box.right > column.right + 1;
    if (hidden) {
      var head = table.querySelector('th, td');
      found.push({table: i + 1, width: Math.round(box.width), column: Math.round(column.width),
                  first_cell: head ? head.textContent.trim().slice(0, 40) : ''});
    }
  });
  document.body.setAttribute('MARK', JSON.stringify(found));
});
</script>""".replace("MARK", _MARK)


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def _render(browser: str, page: Path, width: int, extra: list[str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="deepepochs-chromium-") as profile:
        return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},900",
                               *extra, page.as_uri()], capture_output=True, text=True, timeout=120)


def overflowing_tables(browser: str, page: Path, width: int = 1280) -> list[dict]:
    """The tables of `page` (an HTML file of the built site) that are wider than its content column when
    Chromium renders it `width` pixels wide; each `{table, width, column, first_cell}` (1-based index)."""
    probe = page.with_name(f".check-{page.name}")  # beside the page: its relative links still resolve
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>", 1))
    try:
        done = _render(browser, probe, width, ["--dump-dom"])
    finally:
        probe.unlink()
    found = re.search(rf'{_MARK}="([^"]*)"', done.stdout)
    if found is None:
        raise RuntimeError(f"{page}: Chromium printed no measurement (exit {done.returncode}): {done.stderr[-500:]}")
    return json.loads(html.unescape(found.group(1)))


def check_site(site: Path, width: int = 1280) -> dict[str, list[dict]]:
    """`{page: overflowing tables}` for every page of `site` with at least one (empty: all fit)."""
    browser = _browser()
    if browser is None:
        raise FileNotFoundError(f"no Chromium found (looked for {', '.join(BROWSERS)}); install it, e.g."
                                " apt-get install chromium")
    pages = sorted(p for p in site.rglob("*.html") if not p.name.startswith(".")
                   and not {"_static", "_sources", "_modules"} & set(p.relative_to(site).parts))
    if not pages:
        raise FileNotFoundError(f"{site} holds no HTML pages; build the site first (make docs)")
    problems = {}
    for page in pages:
        tables = overflowing_tables(browser, page, width)
        if tables:
            problems[str(page.relative_to(site))] = tables
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default=os.fspath(SITE), help="the built site (default: docs/_build/html)")
    parser.add_argument("--width", type=int, default=1280, help="the window width in pixels (default 1280)")
    parser.add_argument("--screenshot", nargs="+", metavar=("OUT_DIR", "PAGE"),
                        help="also save PNGs of these pages into OUT_DIR")
    args = parser.parse_args(argv)
    site = Path(args.site).resolve()
    try:
        problems = check_site(site, args.width)
    except FileNotFoundError as e:
        print(f"docs-check: {e}", file=sys.stderr)
        return 2
    if args.screenshot:
        out, *names = args.screenshot
        Path(out).mkdir(parents=True, exist_ok=True)
        for name in names:
            target = Path(out).resolve() / (name.replace("/", "-").removesuffix(".html") + ".png")
            _render(_browser(), site / name, args.width, [f"--screenshot={target}"])
            print(f"docs-check: {name} -> {target}")
    for page, tables in problems.items():
        for t in tables:
            print(f"docs-check: {page}: table {t['table']} ({t['first_cell']!r}...) is {t['width']} px wide in a"
                  f" {t['column']} px column at {args.width} px")
    pages = len([p for p in site.rglob("*.html") if not {"_static", "_sources", "_modules"} & set(p.parts)])
    print(f"docs-check: {pages} pages rendered at {args.width} px; "
          + (f"{sum(map(len, problems.values()))} table(s) do not fit" if problems else "every table fits"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
