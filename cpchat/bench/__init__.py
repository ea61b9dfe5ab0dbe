"""`cpchat bench`: cpchat against mlx-lm's own stream_generate, side by side in one run."""

from cpchat.bench.run import main

__all__ = ["main"]
