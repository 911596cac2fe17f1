"""What every row of `bench testbed` trains, and what it trains to: the workload both the
testbed (`testbed.py`) and the simulator's calibration on it (`testbed_calibration.py`) run."""

from __future__ import annotations

ISLANDS = 4
LR = 3e-3  # the shipped inner AdamW lr, every row
H = 50
ROUNDS = 12  # the budget, and so the lr schedule's length; a row stops at the target
DDP_STEPS = H * ROUNDS  # the same step budget (and so the same lr schedule) as the DiLoCo rows
POWERSGD_RANK = 4
POWERSGD_START = 10  # plain all-reduce steps before PowerSGD compresses (torch's advice: not the first)
TARGET = 2.6  # eval loss: what the default task's DiLoCo reaches in a few rounds of H = 50
ROWS = {
    "ddp_fp32": "torch DDP, gloo, no hook (fp32 all-reduce)",
    "ddp_bf16": "torch DDP, gloo, fp16_compress_hook (gloo has no bf16 all-reduce)",
    "ddp_powersgd": f"torch DDP, gloo, powerSGD_hook rank {POWERSGD_RANK} (from step {POWERSGD_START})",
    "diloco": f"DiLoCo H={H}, fp32 both ways",
    "streaming_int4": "Streaming DiLoCo (2 fragments: H = 50 splits into 2 segments, not the shipped 4), int4 both ways",
    "async": "the shipped async default (quorum pacing, DyLU)",
}
ARCHIPELAGO = {  # archipelago's rows: `archipelago run`'s settings
    "diloco": ["--set=mode=diloco"],
    "streaming_int4": [
        "--set=mode=streaming",
        "--set=mode.fragments=2",
        "--set=compression.codec=int4",
        "--set=compression.downlink=int4",
    ],
    "async": ["--set=mode=async"],
}
