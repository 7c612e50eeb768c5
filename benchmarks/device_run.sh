#!/bin/bash
# How the H100 runs in docs/results were made: sleuth on a lent GPU machine that reaches no network and takes at most
# 64 MiB of files per call (the working tree included). SmolLM2's GGUF (98 MB) and the wheels sleuth needs beyond the
# machine's image do not fit in one call, so they travel in two, and the machine's /tmp keeps what the first brought
# (the repository copy is replaced on every call; /tmp is kept while the machine stays warm, 30 s between calls).
#
#   bash benchmarks/device_run.sh prepare        # here: .gpu-carry/1 (wheels + model part 1), .gpu-carry/2 (part 2)
#   device call 1, carry [".gpu-carry/1"]:  bash benchmarks/device_run.sh stash
#   device call 2, carry [".gpu-carry/2"]:  bash benchmarks/device_run.sh run python3 benchmarks/gpu_check.py
#   later calls (same warm machine, nothing carried):  bash benchmarks/device_run.sh again python3 ...
#
# Benchmarks that read ../shared/data (learn_arena, learn_real) need its files too, which fit in neither call above:
#   bash benchmarks/device_run.sh prepare-data hotpotqa/hotpot.json ...   # here: .gpu-carry/data (paths under data/)
#   a later call, carry [".gpu-carry/data"]:  bash benchmarks/device_run.sh again python3 benchmarks/learn_arena.py ...
# `run` and `again` link ../shared/data to the carried copy when it came along (the device gets no ../shared).
#
# `run` assembles and converts the model into SLEUTH_HOME=/tmp/gs/home (sha256 checked), runs the command with
# sleuth on PYTHONPATH, then packs $SLEUTH_HOME/runs (weights, checkpoints and indexes left out) into
# $OUT/runs.tgz. STOP_AFTER=SECONDS is a deadline counted from this script's start (the model's assembly and
# conversion included), at which the command is stopped in time for the packing (default 540). Give the device call
# a timeout_s at least 30 s above it: a call killed by its own timeout packs nothing.
# Measured 2026-11-26 (H100): call 1 ~20 s, the model ready 15-42 s into call 2.
set -u
SCRIPT_STARTED=$(date +%s)
MODE=${1:-}; shift || true
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${GPU_STATE:-/tmp/gs}
PY=${PY:-python3}  # the device image's interpreter (a dry run here: PY=.venv/bin/python NO_INSTALL=1)
CARRY=$ROOT/.gpu-carry
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# what the device image (python 3.12, torch 2.11, transformers 5.17, no trl/datasets/gguf/bm25s) lacks, at the pins
# of pyproject.toml; tokenizers and hf-xet are left to the image (0.23.2 / 1.6.0 satisfy the pins' ranges) for room
WHEELS="transformers==5.23.0 huggingface-hub==2.4.0 trl==1.16.0 peft==0.21.2 datasets==5.2.0 gguf==0.19.0
bm25s==0.3.16 PyStemmer==3.1.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
dill==0.4.1 multiprocess==0.70.19 typer==0.29.2 rich==15.0.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
idna==3.20 anyio==4.16.0 h11==0.16.0 click==8.5.1 typing_extensions==4.16.0 fsspec==2026.9.0 regex==2026.11.19
annotated-doc==0.0.7"

env_for_sleuth() {
  if [ -d "$CARRY/data" ]; then
    mkdir -p "$(dirname "$ROOT")/shared" && ln -sfn "$CARRY/data" "$(dirname "$ROOT")/shared/data"
  fi
  export PYTHONPATH=$ROOT/src:$STATE/site SLEUTH_HOME=$STATE/home PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false
}

run_command() {
  local started=$(date +%s) out=${OUT:-/tmp/out}
  local left=$(( ${STOP_AFTER:-540} - (started - SCRIPT_STARTED) ))
  (( left > 0 )) || left=1
  mkdir -p "$out"
  timeout "$left" "$@" > "$out/command.log" 2>&1
  echo "command rc=$? after $(( $(date +%s) - started )) s"
  # progress bars are carriage-return lines: the last 40 of the rest
  tr '\r' '\n' < "$out/command.log" | grep -v "it/s\]$\|s/it\]$\|examples/s\]$" | tail -40
  if [ -d "$SLEUTH_HOME/runs" ]; then
    tar czf "$out/runs.tgz" -C "$SLEUTH_HOME/runs" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
      --exclude='*.pth' --exclude='checkpoint-*' --exclude='index' --exclude='corpus.jsonl' .
  fi
  gzip -f "$out/command.log"
  ls -l "$out"
}

case "$MODE" in
  prepare)
    python=${PYTHON:-$ROOT/.venv/bin/python}
    rm -rf "$CARRY" && mkdir -p "$CARRY/1/whl" "$CARRY/2"
    # shellcheck disable=SC2086
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$CARRY/1/whl" $WHEELS || exit 1
    home=${SLEUTH_HOME:-$HOME/.cache/sleuth}/assets/smollm2
    [ -f "$home/$GGUF" ] || { echo "fetch SmolLM2 first: sleuth assets fetch" >&2; exit 1; }
    cp "$home/.sleuth-asset.json" "$CARRY/1/asset.json"
    # xz saves 8%: what makes both calls fit under 64 MiB with the working tree (about 5 MB)
    xz -T2 -6 -c "$home/$GGUF" > "$CARRY/model.xz"
    head -c 35000000 "$CARRY/model.xz" > "$CARRY/1/part" && tail -c +35000001 "$CARRY/model.xz" > "$CARRY/2/part"
    rm "$CARRY/model.xz"
    du -sb "$CARRY"/1 "$CARRY"/2
    ;;
  prepare-data)
    data=$(dirname "$ROOT")/shared/data
    rm -rf "$CARRY/data"
    for f in "$@"; do
      mkdir -p "$CARRY/data/$(dirname "$f")" && cp "$data/$f" "$CARRY/data/$f" || exit 1
    done
    du -sb "$CARRY/data"
    ;;
  stash)
    mkdir -p "$STATE"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if [ -z "${NO_INSTALL:-}" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
        "$CARRY"/1/whl/*.whl 2>&1 | tail -3
    fi
    cp "$CARRY/1/part" "$STATE/model.1" && cp "$CARRY/1/asset.json" "$STATE/asset.json"
    env_for_sleuth
    "$PY" -c "import torch, transformers, trl, datasets, sleuth.train.sft, sleuth.train.mdpo, sleuth.retrieval.bm25
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
    ;;
  run)
    [ -f "$STATE/model.1" ] || { echo "no $STATE/model.1: call 'stash' first on this machine" >&2; exit 3; }
    env_for_sleuth
    assets=$SLEUTH_HOME/assets/smollm2
    mkdir -p "$assets"
    "$PY" - "$STATE/model.1" "$CARRY/2/part" "$assets/$GGUF" "$GGUF_SHA" <<'PY' || exit 3
import hashlib, lzma, sys
data = lzma.decompress(open(sys.argv[1], "rb").read() + open(sys.argv[2], "rb").read())
assert hashlib.sha256(data).hexdigest() == sys.argv[4], "the model's parts do not assemble to the fetched GGUF"
open(sys.argv[3], "wb").write(data)
PY
    cp "$STATE/asset.json" "$assets/.sleuth-asset.json"
    "$PY" -c "from sleuth.assets import fetch_assets; fetch_assets(['smollm2'])" || exit 4
    run_command "$@"
    ;;
  again)
    env_for_sleuth
    run_command "$@"
    ;;
  *)
    echo "usage: $0 prepare | prepare-data FILE... | stash | run COMMAND... | again COMMAND..." >&2
    exit 2
    ;;
esac
