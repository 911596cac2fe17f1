"""The island side of Archipelago, in three parts: `wire/` (what crosses between the
coordinator and an island, and the layout both share: the only part the engine imports
besides the task contract), `tasks/` (what is trained) and `runtime/` (the island that
trains it, and its Ray shells)."""
