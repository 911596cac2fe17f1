"""Ray: the coordinator actor over the engine, the Ray island pool (placement groups,
actors), coordinator slices as actors, metrics, and the driver that starts a run."""
