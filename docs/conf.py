"""Sphinx configuration of plfl's documentation: Markdown pages (MyST), the API reference from docstrings
(autodoc, Google style through napoleon) and the pages generated from the code (``_ext/plfl_docs.py``).

Mathematics: ``$...$`` and ``$$...$$`` (and amsmath environments) in Markdown, the ``:math:`` role and the
``.. math::`` directive in docstrings. MathJax renders it from the copy that ``sphinx-mathjax-offline`` puts in
``_static/mathjax``, so that the site loads nothing from a CDN.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``.ci/run`` does, warnings as errors).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]

import plfl  # noqa: E402  (after the path above)

project = "plfl"
author = "plfl developers"
release = version = plfl.__version__
copyright = "plfl developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 in _static/mathjax instead of a CDN's (it sets mathjax_path)
    "plfl_docs",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath"]
# $...$ is math only where it hugs its formula: "$x_i$" is, "$ x $" and "$5 to $10" are not
myst_dmath_allow_space = False
myst_dmath_allow_digits = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
autodoc_inherit_docstrings = False  # a Lightning hook plfl overrides keeps its own (or no) docstring
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"plfl {release}"
html_static_path = ["_static"]
html_css_files = ["plfl.css"]
