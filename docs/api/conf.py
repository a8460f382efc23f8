"""Sphinx configuration of the API reference (``make docs``; built with ``-W`` in ``make test``:
a docstring that does not parse or a documented name that no longer exists fails the build)."""

project = "fxshard"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_typehints = "none"  # the signatures say enough; torch's types are not ours to link
autodoc_member_order = "bysource"
html_theme = "alabaster"
