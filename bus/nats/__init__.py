"""NATS plumbing under every plane: connections, the embedded server and cluster, TLS,
per-role and per-job keys, provisioning, publishing with PubAcks, refusals, pulls, the outbox."""
