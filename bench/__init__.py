"""Benchmarks: speed and memory against peers, FLOP tables against the papers."""
