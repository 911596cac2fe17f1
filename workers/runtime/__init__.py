"""The island runtime: `Island` (pure: H inner steps from the global parameters, Δ back),
its Ray actor shells (one actor, or a group of workers with ZeRO-1 or FSDP2), and the
inner optimizer."""
