"""Coordinator side of Archipelago (`archipelago.orchestrator`): config, outer optimizers,
aggregation, the coordinator, the CLI."""
