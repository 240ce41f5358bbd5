#!/usr/bin/env bash
# Tensor-parallel generation: torchrun starts one scripts/generate.py process per rank, each loading
# only its shard of the target (NCCL on GPUs, one per rank; gloo on CPU).
#
#   bash scripts/launch_tp.sh --model models/qwen2.5-coder-0.5b --max-new-tokens 64
#   NPROC=4 bash scripts/launch_tp.sh ...             # degree of parallelism (default 2)
#   SPEC_TP_TIMEOUT=120 bash scripts/launch_tp.sh ... # seconds before a hung worker fails the run
#   SPEC_TP_CHECK=1 bash scripts/launch_tp.sh ...     # compare logits across ranks every pass
#
# Every other argument goes to scripts/generate.py; only rank 0 prints.
set -euo pipefail

NPROC="${NPROC:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Ranks share the machine's cores: without a limit every rank starts a thread per core and they
# fight (on this 2-core box, 1 thread each). torchrun would otherwise force 1 and warn about it.
CORES="$(nproc 2>/dev/null || echo 1)"
PER_RANK=$(( CORES / NPROC ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( PER_RANK > 0 ? PER_RANK : 1 ))}"

# torchrun (via parallel/launch.py: the same launcher, without its traceback on failure);
# --standalone: a private rendezvous on a free port, so concurrent launches do not collide.
exec python "$ROOT/parallel/launch.py" --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    "$ROOT/scripts/generate.py" --tp "$NPROC" "$@"
