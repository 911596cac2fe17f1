"""Island side of Archipelago: the Task contract, the default task, the inner loop, the island actor."""
