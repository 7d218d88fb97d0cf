"""Sphinx configuration of the API reference (``make docs``: docs/api -> build/docs).

Only the reference is built here: the guides are the Markdown files beside it.
Warnings are errors and every cross-reference must resolve (``-W -n``).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import switchml  # noqa: E402

project = "switchml"
release = version = switchml.__version__
extensions = ["sphinx.ext.autodoc"]
# a method that overrides torch's without a docstring of its own is not documented
# with torch's
autodoc_inherit_docstrings = False
# the docstrings name types in prose; signatures keep their annotations, unlinked
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# imports that are optional extras (numpy is the one required dependency)
autodoc_mock_imports = ["prometheus_client"]
# Types from outside the package that a signature names, which Sphinx cannot link
# without a network (no intersphinx here): left unlinked rather than warned about.
nitpick_ignore_regex = [
    ("py:class", r"(np|numpy|torch|dist|c10d|socket|subprocess|threading|collections|"
                 r"typing|concurrent|dataclasses|argparse|os|_?io)\..*"),
    ("py:class", r"c10d::.*"),
]
html_theme = "alabaster"
html_title = f"switchml {release} API reference"
exclude_patterns = ["_build"]
