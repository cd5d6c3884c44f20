"""The control plane: commands broadcast and counted by quorum, a worker's receiver and
acks, membership, the desired state, and the fleet as an operator reads it."""
