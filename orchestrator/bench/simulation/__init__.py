"""The simulator, beside the product: what tests, benchmarks and `archipelago simulate` run
the product with, and the product never imports (an architecture test says so).

- `config`: the simulated fleet (`SimulationConfig`: speeds, links, the head's card, what
  is priced), read beside a run's config, never inside it (`load_simulated`);
- `links` and `network`: what each transfer and the coordinator's step cost on the virtual
  clock — the `Transfers` the engine's seam reads;
- `pool`: the in-process island pool on the virtual clock, with injected faults; `chaos`:
  failures in time; `runner`: a whole run in this process;
- `ray_pool`: the Ray island pool on the virtual clock (the islands are real actors).

The product keeps two seams for it: the island pool protocol (`engine/pool.py`) and the
`Transfers` a pool hands the engine (`engine/links.py`, free on a real clock).
"""
