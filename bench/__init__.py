"""Benchmarks that compare rlfabric side by side with the HTTP way, in one run each.

`rlfabric bench rollout|control|weights|grpo` runs them; every one prints a table (or
`--json`). `sim` holds the simulated workers `bench control` and the tests use.
"""
