"""dpgrad's version: a module of its own, so that what records it imports no package."""

__version__ = "0.1.0"
