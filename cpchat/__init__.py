"""cpchat: chat over very long contexts with context-parallel attention."""

__version__ = "0.1.0"
