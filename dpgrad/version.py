"""dpgrad's version: a module of its own, so that what records it imports no package.

The one place the version is written: pyproject.toml reads it from here
(``[tool.setuptools.dynamic]``; setuptools parses this assignment without importing dpgrad),
and CHANGELOG.md's newest release heading names it.
"""

__version__ = "0.1.0"
