"""The run's shared state, below every family of the engine that reads or changes it: the
membership and the islands' records, the data ledger, the work in flight (`flights.py`), the
event log and the records beside it, checkpoint files, and the typed views of all of it.
Nothing here imports the families above (fleet, work, pacing, step, outputs, commands), so
each of them can be handed the parts it uses without importing the others."""
