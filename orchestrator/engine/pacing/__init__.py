"""Pacing: when an outer step closes and what is handed out meanwhile — the protocol and the barrier-family pacings, per-arrival steps, the quorum rule, and the pacings' registry."""
