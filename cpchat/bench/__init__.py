"""`cpchat bench`: cpchat against mlx-lm's own stream_generate, side by side in one run.

cli.py is the entry point; it runs compare_mlx_lm.py (with transport.py) or compare_algorithms.py,
which build their models with models.py, draw with charts.py and start baseline.py, attention.py,
mxdist.py and wirefloor.py as child processes.
"""

from cpchat.bench.cli import main

__all__ = ["main"]
