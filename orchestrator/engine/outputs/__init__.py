"""What a run writes and shows: records, events and their rotation, checkpoints and what they capture, the typed views and metrics, the counters, and the evaluation of the global model."""
