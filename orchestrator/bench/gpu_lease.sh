#!/usr/bin/env bash
# One lease of a GPU for issue 90, in at most TOTAL_S (6 minutes) of its ~15: `archipelago
# bench gpu`'s parts that decide the issue — the peak, the island against the bare loop, the
# rows that fill the GPU, the 124 M GPT-2 island's profile, the reference loop on the same
# model and batch (its tokens/s, MFU and top kernels), and the 124 M island on Ray (the MFU
# row) — within a whole budget of BUDGET_S (a part that would overrun it is skipped, and the
# report is written whatever happens), then the CUDA tests of what this issue changed on the
# device (the pinned stage, the fused AdamW, compilation), then a summary of the top
# kernels, island and reference side by side, printed and kept.
#
# The six minutes are a bound, not an estimate: every step that can take time runs under
# `timeout` (a TERM at its limit, a KILL KILL_S later), the checks and the install with their
# own limits, the bench with what is left of TOTAL_S once the tests' and the summary's limits
# are set aside; the bench's --budget is BUDGET_S, or less where the install or the checks
# took its time, so that it ends GRACE_S before its limit (a Ray run is stopped at its
# round's end, then its report is written). Without the install and with the checks at their
# limit, the whole BUDGET_S fits (tests/test_bench.py checks this arithmetic from this file).
#
# Run from the repository's root on the lent machine (the `run` tool: its $OUT comes back),
# with a timeout that leaves time to run it again (timeout_s 390):
#   ARCHIPELAGO_COMMIT=<the commit the copy was made from> [ARCHIPELAGO_TREE_CLEAN=1] \
#   [WHEELS=<folder of wheels for what the machine lacks>] orchestrator/bench/gpu_lease.sh
# Then, here: `archipelago bench publish gpu --out <files_at>/bench` (a clean tree's commit)
# and commit docs/gpu.json, .md and .png; the findings go to docs/findings/gpu.md.
set -uo pipefail

OUT=${OUT:?the folder whose files come back (the run tool sets it)}
export ARCHIPELAGO_COMMIT=${ARCHIPELAGO_COMMIT:?the commit this copy was made from: git rev-parse HEAD where it was sent}
TOTAL_S=360   # the whole script, every step in it
CHECK_S=15    # what the machine has: the modules, the bench's command, the device
INSTALL_S=60  # the offline install, only where the machine lacks this checkout's commands
TESTS_S=45    # the CUDA tests
SUMMARY_S=10  # the top kernels and the headline figures, read from the report
KILL_S=5      # a step given a TERM at its limit is killed this much later
GRACE_S=20    # the bench past its --budget (a run stopped at its round's end, the report written)
BUDGET_S=${BUDGET_S:-240}
PARTS=peak,bareloop,fill,profile,reference,ray,gpt2_124m_1gpu
WORK=${TMPDIR:-/tmp}/archipelago-gpu-lease  # the runs' folders: checkpoints too large to send back
started=$SECONDS

say() { echo "[gpu_lease $((SECONDS - started)) s] $*"; }
within() { timeout -k "$KILL_S" "$@"; } # within SECONDS COMMAND...: the command, TERM at SECONDS, KILL after

# What the machine has, in seconds: stop at once, saying what is missing, rather than spend the lease.
check() {
    within "$CHECK_S" python - <<'EOF'
import importlib.util
import sys

if importlib.util.find_spec("archipelago.orchestrator.bench") is None:
    sys.exit(4)  # this checkout is not installed: install it, then check again
missing = [m for m in ("torch", "ray", "transformers", "matplotlib", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)} (carry wheels for this machine's Python and give WHEELS=<folder>)")
import torch

if not torch.cuda.is_available():
    sys.exit("no CUDA device")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF
}
check
checked=$?
if [ "$checked" -eq 4 ]; then
    say "installing this checkout, editable and offline"
    if [ -n "${WHEELS:-}" ]; then
        within "$INSTALL_S" python -m pip install -q --no-index --find-links "$WHEELS" -e . -e orchestrator/bench || exit 3
    else
        within "$INSTALL_S" python -m pip install -q --no-index --no-deps --no-build-isolation -e . -e orchestrator/bench || exit 3
    fi
    check
    checked=$?
fi
[ "$checked" -eq 0 ] || exit 3

# the bench's hard limit: what TOTAL_S leaves once the tests and the summary have theirs (each with its KILL_S)
bench_s=$((TOTAL_S - (SECONDS - started) - 1 - TESTS_S - KILL_S - SUMMARY_S - KILL_S - KILL_S))
budget=$((bench_s - GRACE_S < BUDGET_S ? bench_s - GRACE_S : BUDGET_S))
[ "$budget" -gt 0 ] || { say "no time left for the bench"; exit 3; }
say "bench gpu --parts $PARTS --budget $budget (stopped at $bench_s s)"
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT/bench"
within "$bench_s" archipelago bench gpu --parts "$PARTS" --budget "$budget" --out "$WORK" >"$OUT/bench.log" 2>&1
bench_rc=$?
tail -n 3 "$OUT/bench.log"
cp "$WORK"/gpu.json "$WORK"/gpu.md "$WORK"/gpu.png "$OUT/bench/" 2>/dev/null

say "cuda tests of the pinned stage, the fused AdamW and compilation"
within "$TESTS_S" python -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -k "pinned or fused or compiles" \
    >"$OUT/cuda-tests.txt" 2>&1
tail -n 2 "$OUT/cuda-tests.txt"

if [ -f "$OUT/bench/gpu.md" ]; then
    # the island's step, then the loops side by side and the reference loop's step: their top kernels
    sed -n '/^### Where a step/,/^### Runs on the GPU/p' "$OUT/bench/gpu.md" | sed '$d' >"$OUT/top-kernels.md"
    cat "$OUT/top-kernels.md"
    within "$SUMMARY_S" python - "$OUT/bench/gpu.json" <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("device", "mfu_124m", "mfu_124m_island", "mfu_reference", "island_vs_bare_loop")})
print({k: v["status"] for k, v in r["parts"].items()})
EOF
fi
say "done (bench exit $bench_rc)"
exit "$bench_rc"
