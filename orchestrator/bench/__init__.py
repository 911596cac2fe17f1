"""Benchmarks: `archipelago bench <scenario> [--quick] --out DIR` (registry in `registry.py`)."""
