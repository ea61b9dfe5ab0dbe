"""cpchat: chat over very long contexts with context-parallel attention."""

__version__ = "0.1.0"

# Exit status of every front end (docs/design.md §1): done, usage / bad input, backend failure.
EXIT_OK, EXIT_USAGE, EXIT_BACKEND = 0, 2, 3
