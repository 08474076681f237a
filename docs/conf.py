"""Sphinx configuration of the deepepochs documentation site (`make docs`; Markdown pages through MyST)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout's package, not another installed copy

import deepepochs  # noqa: E402

project = "deepepochs"
author = "deepepochs authors"
copyright = "deepepochs authors"
release = version = deepepochs.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# micro-batch.md is generated from the spec and included by debugging.md; the build folder is output.
exclude_patterns = ["_build", "micro-batch.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # no "Return type: None" under every method
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# No network at build time: links to PyTorch's documentation are plain links (no intersphinx inventory).
nitpicky = False

html_theme = "furo"
html_title = f"deepepochs {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
default_role = "code"  # `x` in docstrings is code, as in Markdown


def _trainer_arguments(app, what, name, obj, options, lines):
    """`Trainer` adds nothing to `TrainerBase`, which holds the arguments: show them on `Trainer`'s entry,
    where readers look, and keep `TrainerBase`'s entry to what subclassing it means."""
    if what != "class" or name not in ("deepepochs.Trainer", "deepepochs.TrainerBase"):
        return
    from sphinx.util.docstrings import prepare_docstring

    base = prepare_docstring(deepepochs.TrainerBase.__doc__)
    args = next(i for i, line in enumerate(base) if line.strip() == "Args:")
    if name == "deepepochs.Trainer":
        lines[:] = [*lines, "", *base[args:]]
    else:
        lines[:] = [*base[:args], "It takes the arguments of `Trainer` above.", ""]


def setup(app):
    # Before napoleon (priority 500), so that the Google-style sections added here are converted too.
    app.connect("autodoc-process-docstring", _trainer_arguments, priority=400)
