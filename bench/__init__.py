"""Benchmarks that compare rlfabric side by side with the HTTP way, in one run each.

`rlfabric bench rollout|quorum` runs them; every one prints a table (or `--json`).
"""
