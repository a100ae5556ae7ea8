#!/usr/bin/env bash
# GPU check of hftk's CUDA-only paths, for the next session lent an NVIDIA GPU (one is enough;
# under 8 minutes on one H200). It runs the suite's GPU-relevant in-process tests, then short real
# runs under torchrun (NCCL): ddp fp32 / bf16 / tf32 / fp16 at world size 1 (an overflow the loss
# scaler skips must not stop the run), fsdp bf16, zero3 bf16, zero3_offload bf16 on 2 ranks where 2
# GPUs are lent (hftk refuses to shard over one rank; one GPU: said in the summary), a resume with
# dropout on (losses after the resume equal the uninterrupted run's), and writes
# summary.md (tokens/s, MFU, peak memory per run, from each run's metrics.jsonl) plus the logs to
# the folder given as $1 (default: $OUT when set, else gpu_check_out). The multi-rank layouts
# (tp2 x fsdp2, cp2 x tp2, sp2, pp2) are built and stepped once on the GPU in fp32 and bf16 in one
# process (scripts/gpu_check_layouts.py: torch's fake process group; pp2 as two stages on one rank).
# Throughput: a 1.1B Llama-shaped model (scripts/gpu_check_model.py, random weights) trained in
# bf16 at block 2048 with SDPA and fused AdamW, tokens/s and MFU against the GPU's dense bf16 peak
# (goal 45%). Qwen3- and Gemma 3-shaped models (scripts/gpu_check_model.py --family) train in bf16 too, and
# where 2 GPUs are lent the Qwen3-MoE-shaped one also under expert parallel (ep 2: its tokens reach their experts
# by NCCL all-to-all), gated like fsdp_bf16.
# On a machine without a GPU it says so and exits 1.
#
# Python: $PYTHON, else .venv/bin/python, else python3. Packages missing there can be carried as
# wheels in .whl/ (docs/guides/gpus.md, "The GPU check"); they are installed into a private folder, never over torch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi lists none); run it where one is lent" >&2
  exit 1
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hftk-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hftk-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
"$PY" - <<'PY' 2>&1 | tee "$OUT_DIR/environment.txt" || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: nvidia-smi lists a GPU but torch {torch.__version__} sees none (a CPU wheel?)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0)}")
missing = []
for name in ("transformers", "accelerate", "deepspeed", "datasets", "peft", "hftk"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '')}")
    except Exception as exc:  # report every missing package at once, then fail
        missing.append(f"{name} ({exc})")
if torch.__version__.split("+")[0] != "2.13.0":
    print(f"gpu_check: note: hftk is pinned to torch 2.13.0, this is {torch.__version__}")
if missing:
    sys.exit("gpu_check: cannot import " + "; ".join(missing))
PY

declare -A RC
step() {  # step NAME COMMAND...: run, log to $OUT_DIR/NAME.log, remember the exit code
  local name=$1; shift
  echo "== $name"
  timeout 240 "$@" >"$OUT_DIR/$name.log" 2>&1
  RC[$name]=$?
  echo "   exit ${RC[$name]} ($(tail -n 1 "$OUT_DIR/$name.log" | cut -c1-150))"
}

step tests "$PY" -m pytest -q -rs -p no:cacheprovider -m "not slow" -k "not setup_refuses" tests/unit/engine/test_resilience.py \
  tests/unit/run/test_validate.py::test_fp16_weights_with_fp16_training_are_refused_before_launch \
  tests/unit/run/test_validate.py::test_fp16_weights_are_fine_where_fp32_master_weights_exist \
  tests/unit/checkpoint/test_atomic.py::test_load_rng_continues_every_generator_exactly \
  tests/unit/checkpoint/test_atomic.py::test_a_rank_without_a_saved_state_keeps_its_generators \
  tests/unit/telemetry/test_rank_monitor.py tests/integration/test_telemetry.py tests/unit/test_gpu_readiness.py \
  tests/integration/test_gpu_readiness.py \
  "tests/unit/strategies/test_deepspeed.py::test_offload_without_a_toolchain_is_one_line_before_launch"

WORK=$(mktemp -d /tmp/hftk-gpu-check.XXXX)
COMMON=(--model_name_or_path builtin:gpt2-90m --model_dropout 0 --block_size 1024 --max_train_samples 4000
        --per_device_train_batch_size 8 --max_steps 30 --logging_steps 10 --learning_rate 3e-4
        --lr_scheduler_type constant --warmup_steps 0 --eval_strategy no --save_strategy no --report_to none
        --disable_tqdm true --seed 7)
NPROC=1
train() {  # train NAME ARGS...: $NPROC ranks under torchrun (NCCL), hftk's real entry point
  local name=$1; shift
  step "$name" "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --standalone \
    scripts/finetune.py "${COMMON[@]}" --output_dir "$WORK/$name" "$@"
}
RUNS=(ddp_fp32 ddp_tf32 ddp_bf16 ddp_fp16)
train ddp_fp32 --strategy ddp
train ddp_tf32 --strategy ddp --tf32 true
train ddp_bf16 --strategy ddp --bf16
train ddp_fp16 --strategy ddp --fp16 --nan_policy stop  # first steps overflow at scale 2**16
# Sharding needs two ranks (hftk refuses fsdp / zero3 over one: nothing to shard) and NCCL one GPU per rank.
if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ]; then
  NPROC=2
  train fsdp_bf16 --strategy fsdp --bf16
  train zero3_bf16 --strategy zero3 --bf16
  train zero3_offload_bf16 --strategy zero3_offload --bf16
  NPROC=1
  RUNS+=(fsdp_bf16 zero3_bf16 zero3_offload_bf16)
  SHARDED="fsdp / zero3 / zero3_offload / ep: 2 ranks (rows above)"
else
  SHARDED="fsdp / zero3 / zero3_offload / ep: not run (one GPU; sharding needs 2 ranks, one GPU each)"
fi

# The multi-rank layouts on this one GPU, in one process (fake process group; see the script's docstring).
step layouts "$PY" scripts/gpu_check_layouts.py --dtypes fp32,bf16

# Throughput: 1.1B Llama-shaped, bf16 autocast over fp32 master weights, SDPA, fused AdamW (the
# Trainer's optimizer; hftk_run.json records it), micro-batch 8 x 2048 tokens, no checkpointing needed.
step model_1b "$PY" scripts/gpu_check_model.py "$WORK/llama-1b"
step llama1b_bf16 "$PY" -m torch.distributed.run --nproc_per_node 1 --standalone scripts/finetune.py \
  --model_name_or_path "$WORK/llama-1b" --strategy ddp --bf16 --attn_implementation sdpa \
  --optim adamw_torch_fused --block_size 2048 --per_device_train_batch_size 8 --max_steps 40 \
  --logging_steps 10 --learning_rate 1e-4 --lr_scheduler_type constant --warmup_steps 0 --model_dropout 0 \
  --eval_strategy no --save_strategy no --report_to none --disable_tqdm true --seed 7 --output_dir "$WORK/llama1b_bf16"

# Families beyond Llama: a ~0.2B Qwen3 (q/k norms), Gemma 3 (sliding / full layers, scaled embedding, tied
# head) and Qwen3-MoE (8 experts, top-2, grouped_mm, the balancing loss and router metrics) from their own config
# classes, bf16 under ddp on this GPU (fsdp on 2 ranks where 2 GPUs are lent).
for family in qwen3 gemma3_text qwen3_moe; do
  step "model_$family" "$PY" scripts/gpu_check_model.py "$WORK/$family" --family "$family"
  train "${family}_bf16" --model_name_or_path "$WORK/$family" --strategy ddp --bf16 --block_size 1024
  RUNS+=("${family}_bf16")
  if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ]; then
    NPROC=2 train "${family}_fsdp_bf16" --model_name_or_path "$WORK/$family" --strategy fsdp --bf16 --block_size 1024
    RUNS+=("${family}_fsdp_bf16")
    if [ "$family" = qwen3_moe ]; then  # expert parallel: 4 of its 8 experts per rank, NCCL all-to-all
      NPROC=2 train qwen3_moe_ep_bf16 --model_name_or_path "$WORK/$family" --strategy ep --bf16 --block_size 1024
      RUNS+=(qwen3_moe_ep_bf16)
    fi
  fi
done

# Resume with dropout on: 20 steps saving at 10, then a new folder holding only checkpoint-10 resumed.
train resume_full --strategy ddp --bf16 --model_dropout 0.1 --max_steps 20 --logging_steps 1 \
  --save_strategy steps --save_steps 10
mkdir -p "$WORK/resume_resumed" && cp -r "$WORK/resume_full/checkpoint-10" "$WORK/resume_resumed/"
train resume_resumed --strategy ddp --bf16 --model_dropout 0.1 --max_steps 20 --logging_steps 1 \
  --save_strategy steps --save_steps 10 --resume_from_checkpoint latest
step resume_check "$PY" scripts/gpu_check_summary.py --resume "$WORK/resume_full" "$WORK/resume_resumed"

RUNS+=(llama1b_bf16)
{ "$PY" scripts/gpu_check_summary.py "$WORK" "${RUNS[@]}"
  echo; echo "$SHARDED"
  echo; "$PY" scripts/gpu_check_summary.py --mfu "$WORK/llama1b_bf16"
  echo; cat "$OUT_DIR/resume_check.log"
  echo; grep -v '^\[' "$OUT_DIR/layouts.log" | grep -E '^(\||layouts)'
  echo; echo "real 2-rank runs of pipeline, tp, cp, sp: not here (one rank per GPU under NCCL needs 2 GPUs)"; } | tee "$OUT_DIR/summary.md"
rm -rf "$WORK"
failed=0
for name in "${!RC[@]}"; do [ "${RC[$name]}" -eq 0 ] || { echo "gpu_check: $name failed (exit ${RC[$name]}): $OUT_DIR/$name.log" >&2; failed=1; }; done
exit $failed
