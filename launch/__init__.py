"""Launchers that place workers on machines other than as `rlfabric worker` processes.

`rlfabric.launch.ray`: workers as Ray actors in a placement group (the optional `ray` extra).
A launched worker joins over NATS like any other; the trainer needs nothing launcher-specific.
"""
