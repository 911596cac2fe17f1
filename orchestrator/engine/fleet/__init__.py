"""The fleet: every island's life from request to release, membership and its statistics, the islands' saved inner states, and when a silent island counts as stuck."""
