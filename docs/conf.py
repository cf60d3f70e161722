"""Sphinx configuration of the qbits documentation.

Build (from the repository root, with ``pip install -e '.[docs]'``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Warnings are errors: a broken link, a docstring that does not render or a
page missing from the table of contents fails the build (and the test that
runs it, ``tests/test_docs.py``).
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the qbits of this checkout, installed or not

project = "qbits"
author = "qbits authors"
copyright = "qbits authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: GitHub-style heading anchors, so `page.md#a-section` links work
# both on GitHub and in the built site.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

# API reference: Google-style docstrings (napoleon), signatures as written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "alphabetical"
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
autodoc_default_options = {"members": False}

html_theme = "furo"
html_title = "qbits"
html_static_path: list[str] = []
