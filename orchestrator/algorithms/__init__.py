"""Pure algorithms: outer optimizers, aggregation, the norm guard, Dynamic Local Updates.
No Ray, no engine: plain torch and numpy, pinned to reference vectors by the tests."""
