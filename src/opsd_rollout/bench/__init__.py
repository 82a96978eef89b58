"""Benchmarks: rollouts and OPSD steps over matrices of shapes, statistics, reports, plots, compare."""
