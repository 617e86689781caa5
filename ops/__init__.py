"""Operator tooling: benchmarks and the soak test."""
