"""dflash-eval's parts: the sweep, the report, speedups and their intervals, cost curves, suites."""
