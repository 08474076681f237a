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
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# No network at build time: links to PyTorch's documentation are plain links (no intersphinx inventory).
nitpicky = False

html_theme = "furo"
html_title = f"deepepochs {release}"
html_static_path = []
