"""`cpchat serve`: an OpenAI-compatible HTTP API over the ranks."""
