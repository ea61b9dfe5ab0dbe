"""Pure tensor math of context parallelism: no I/O, no processes."""
