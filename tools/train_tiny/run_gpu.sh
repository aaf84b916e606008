#!/usr/bin/env bash
# The embedded model's whole GPU run (one H100 or H200, about 9 minutes): main training, the unlooping phase, MTP
# self-distillation, and (with --evaluate) export and evaluation. Run from the repository root on the GPU
# machine, with .train_data made by prepare.py (CPU):
#
#   tools/train_tiny/run_gpu.sh OUT [--evaluate] [train.py options...]
#
# Writes (each file under 16 MiB, so they can come back from the device machine):
#   OUT/run/train_log.json                 the training log: the unlooping phase under "unloop" (with the greedy
#                                          loop report before and after), the distillation under "distill"
#   OUT/run/distilled-NN.safetensors       the weights to export (HF names, main model and distilled mtp.*)
#   OUT/evaluate.json                      with --evaluate: evaluate.py on the HF export (held-out perplexity,
#                                          MTP agreement, chained acceptance, tool-call prompts, samples)
#   OUT/run_gpu.log                        everything printed
# Then, on CPU: export.py --run OUT/run and ninfer convert (tools/train_tiny/README.md).
#
# Needs python3 with torch and transformers; not ninfer. fla-core stays off the path: the shipped runs used
# transformers' PyTorch GDN path, and with fla the first step spends minutes autotuning its kernels.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: run_gpu.sh OUT [--evaluate] [train.py options...]}
shift
EVALUATE=0
if [ "${1:-}" = --evaluate ]; then EVALUATE=1; shift; fi
[ -f .train_data/meta.json ] || { echo "run_gpu.sh: .train_data is missing (make it with prepare.py)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/train_tiny.XXXXXX)
mkdir -p "$OUT/run"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run_gpu.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
start=$SECONDS
timeout 420 python3 tools/train_tiny/train.py --data .train_data --out "$WORK/run" "$@"
echo "run_gpu.sh: training done after $((SECONDS - start)) s"
timeout 200 python3 tools/train_tiny/unloop.py --run "$WORK/run" --data .train_data
echo "run_gpu.sh: unlooping done after $((SECONDS - start)) s"
timeout 150 python3 tools/train_tiny/distill.py --run "$WORK/run" --data .train_data --hard-weight 0.5
echo "run_gpu.sh: distillation done after $((SECONDS - start)) s"
cp "$WORK/run/train_log.json" "$WORK"/run/distilled-*.safetensors "$OUT/run/"
if [ "$EVALUATE" = 1 ]; then
    timeout 60 python3 tools/train_tiny/export.py --run "$WORK/run" --data .train_data --out "$WORK/hf"
    timeout 300 python3 tools/train_tiny/evaluate.py --hf "$WORK/hf" --data .train_data --out "$OUT/evaluate.json" \
        | tail -n 40
fi
echo "run_gpu.sh: all done after $((SECONDS - start)) s"
