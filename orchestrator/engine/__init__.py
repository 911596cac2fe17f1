"""The round engine and its policies: a state machine over an island pool, pacing,
admission, the data ledger, membership and records. No Ray: the runtime hands it a Ray
island pool; tests hand it an in-process one with injected faults."""
