"""Agent sessions on the bus: each session's log of records, and the claim on its turn."""
