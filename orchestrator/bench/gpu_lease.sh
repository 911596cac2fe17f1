#!/usr/bin/env bash
# One lease of a GPU for issue 90, in at most 6 minutes of its ~15: `archipelago bench gpu`'s
# parts that decide the issue — the peak, the island against the bare loop, the rows that
# fill the GPU, the 124 M GPT-2 island's profile, the reference loop on the same model and
# batch (its tokens/s, MFU and top kernels), and the 124 M island on Ray (the MFU row) —
# within a whole budget of BUDGET_S (300 s: a part that would overrun it is skipped, and the
# report is written whatever happens), then the CUDA tests of what this issue changed on the
# device (the pinned stage, the fused AdamW, compilation), then a summary of the top
# kernels, island and reference side by side, printed and kept.
#
# Run from the repository's root on the lent machine (the `run` tool: its $OUT comes back),
# with a timeout that leaves time to run it again (timeout_s 420):
#   ARCHIPELAGO_COMMIT=<the commit the copy was made from> [ARCHIPELAGO_TREE_CLEAN=1] \
#   [WHEELS=<folder of wheels for what the machine lacks>] orchestrator/bench/gpu_lease.sh
# Then, here: `archipelago bench publish gpu --out <files_at>/bench` (a clean tree's commit)
# and commit docs/gpu.json, .md and .png; the findings go to docs/findings/gpu.md.
set -uo pipefail

OUT=${OUT:?the folder whose files come back (the run tool sets it)}
export ARCHIPELAGO_COMMIT=${ARCHIPELAGO_COMMIT:?the commit this copy was made from: git rev-parse HEAD where it was sent}
BUDGET_S=${BUDGET_S:-300}
PARTS=peak,bareloop,fill,profile,reference,ray,gpt2_124m_1gpu
WORK=${TMPDIR:-/tmp}/archipelago-gpu-lease  # the runs' folders: checkpoints too large to send back
started=$SECONDS

say() { echo "[gpu_lease $((SECONDS - started)) s] $*"; }

# What the machine has, in seconds: stop at once, saying what is missing, rather than spend the lease.
if ! archipelago bench --help >/dev/null 2>&1; then
    say "installing this checkout, editable and offline"
    if [ -n "${WHEELS:-}" ]; then
        python -m pip install -q --no-index --find-links "$WHEELS" -e . -e orchestrator/bench || exit 3
    else
        python -m pip install -q --no-index --no-deps --no-build-isolation -e . -e orchestrator/bench || exit 3
    fi
fi
python - <<'EOF' || exit 3
import importlib.util
import sys

missing = [m for m in ("torch", "ray", "transformers", "matplotlib", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)} (carry wheels for this machine's Python and give WHEELS=<folder>)")
import torch

if not torch.cuda.is_available():
    sys.exit("no CUDA device")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF

say "bench gpu --parts $PARTS --budget $BUDGET_S"
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT/bench"
archipelago bench gpu --parts "$PARTS" --budget "$BUDGET_S" --out "$WORK" >"$OUT/bench.log" 2>&1
bench_rc=$?
tail -n 3 "$OUT/bench.log"
cp "$WORK"/gpu.json "$WORK"/gpu.md "$WORK"/gpu.png "$OUT/bench/" 2>/dev/null

say "cuda tests of the pinned stage, the fused AdamW and compilation"
timeout 90 python -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -k "pinned or fused or compiles" \
    >"$OUT/cuda-tests.txt" 2>&1
tail -n 2 "$OUT/cuda-tests.txt"

if [ -f "$OUT/bench/gpu.md" ]; then
    # the island's step, then the loops side by side and the reference loop's step: their top kernels
    sed -n '/^### Where a step/,/^### Runs on the GPU/p' "$OUT/bench/gpu.md" | sed '$d' >"$OUT/top-kernels.md"
    cat "$OUT/top-kernels.md"
    python - "$OUT/bench/gpu.json" <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("device", "mfu_124m", "mfu_124m_island", "mfu_reference", "island_vs_bare_loop")})
print({k: v["status"] for k, v in r["parts"].items()})
EOF
fi
say "done (bench exit $bench_rc)"
exit "$bench_rc"
