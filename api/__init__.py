"""Control plane of Archipelago (FastAPI); see the control-plane issue."""
