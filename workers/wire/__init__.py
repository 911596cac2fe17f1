"""What crosses between the coordinator and an island, and the layout both sides share: work
orders and results, pseudo-gradient codecs, the published copy's changes, flat parameter
buffers, streaming's fragments. The engine imports only this part of
`workers/` (and the task contract)."""
