"""Coordinator side of Archipelago: config, outer optimizers, aggregation, the coordinator, the CLI."""
