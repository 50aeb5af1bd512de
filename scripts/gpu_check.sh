#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one call (see ../shared/device/README.md).
# Usage on the device:
#   bash scripts/gpu_check.sh [quick|tests|gputests|profile|gemv|b1|b2|moe|moetests|moebench|moesweep|moeprofile|structured|b4|b4adaptive|spechost|verifyfusion|tp|conformance|hostkv|startup|vl|det|detsweep|prefillattn|launch|all]
# (gputests = the GPU engine tests and the GEMV, decode and rotary kernel tests + profile + B1;
#  moe = the mixture-of-experts GPU and kernel tests (moetests), B1/B2 qwen3-30b-a3b with the
#  transformers peer (moebench);
#  moesweep = the expert kernels' routing and tile timings per batch size, qwen3-30b-a3b shapes;
#  moeprofile = benchmarks/profile_decode.py on qwen3-30b-a3b at batch 1 and 8: graph replay
#  time per step and the kernels of a batch-1 step (routing now inside the expert GEMVs);
#  structured = structured-output GPU tests and benchmarks/structured_outputs.py
#  b4 = speculative decoding vs plain decoding, qwen3-0.6b and llama-3.1-8b (batch 64 also
#  with adaptive speculation, next to fixed k and plain decoding in the same run; each oracle
#  row the median of 3 timed runs, as in b4adaptive);
#  b4adaptive = adaptive speculation next to fixed k = 4 and plain decoding, same run: qwen3-0.6b
#  at batch 1 and 64, oracle a = 0.8 and 0.6 (fixed k ran x1.02 / x0.68 at batch 1 in session
#  11: a verify step's host time), llama-3.1-8b at batch 1, a = 0.8 (fixed x2.41 vs adaptive
#  x2.29 in session 13), and at batch 64 and 256, a = 0.6 (fixed k x0.97 at batch 64; at 256
#  adaptive speculation must turn itself off: x1.00 in session 15); adaptive rows print the
#  step costs the policy learnt;
#  spechost = issue 19: the speculative GPU tests (tests/gpu/test_spec_gpu.py,
#  tests/spec/test_spec_graphs.py), then
#  benchmarks/spec_host_time.py on qwen3-0.6b and llama-3.1-8b shapes at batch 1: a plain and
#  a verify step (oracle a = 0.8, k = 4) by phase, host ms vs the steps' device ms, the 16
#  kernels with the most device time per plain and verify step, and for
#  llama-3.1-8b with adaptive speculation too (its policy's share of the verify step's host time);
#  verifyfusion = issue 19: spec_host_time.py on qwen3-0.6b at batch 1 (a = 0.8, k = 4) with the
#  tuning's GEMV choices, then benchmarks/verify_fused_gemv.py, the same with the 8-row bucket
#  of normed and gated layers forced to fused tensor-core GEMVs (each with a tuning cache of its
#  own): a verify step's device time with and without its norm and SiLU kernels;
#  hostkv = the host KV tier (issue 28): its GPU tests, then benchmarks/host_kv_agent.py on
#  llama-3.1-8b shapes: reload vs recompute of a 16,000-token prefix, and the agent workload with
#  a 32k-token device KV pool, without and with a 32 GB pinned host tier, same run;
#  tp = tensor parallelism on 2 GPUs (kind nvidia-h200-x2): its GPU tests, then B1 and B2 of
#  llama-3.1-8b with tp=1 (and the transformers peer) and tp=2, and qwen3-30b-a3b with tp=2;
#  vl = Qwen3-VL (issue 26): the multimodal GPU tests, then benchmarks/vl_images.py on
#  Qwen3-VL-30B-A3B shapes (benchmarks/models/qwen3-vl-30b-a3b, dummy weights): TTFT per
#  1024x768 image, images/s for 64 requests, the vision encoder's share, transformers peer;
#  det = deterministic mode (issue 30): its GPU tests, scripts/determinism_burst.py on the GPU
#  (two identical server bursts under preemption with the demo's draft model), then B1 and B2 of qwen3-0.6b and
#  llama-3.1-8b (engine args of b1/b2, no transformers peer) without and with
#  `--engine-arg deterministic=true`, same run;
#  prefillattn = benchmarks/prefill_attention.py --sweep, then --mixed (qwen3-0.6b heads: a data
#  workload's mixed step against its parts), then --decode --sweep (decode attention over B2's
#  context lengths, every key block, stage and warp count): the prefill attention kernel alone on
#  2k-32k prompts (paged K/V), every candidate tile, against torch SDPA and the matmul rate;
#  launch = the direct launch's GPU tests (tests/gpu/test_launch_gpu.py, and the engine's
#  no-compile-after-warm-up tests, which count the wrapped kernels), then
#  benchmarks/launch_cost.py: host us a call of the add + RMSNorm and SwiGLU wrappers with
#  direct launches off (Triton's own launch) and on;
#  detsweep = benchmarks/invariant_matmul_sweep.py: deterministic mode's matmul, each tile's rows
#  bitwise against the row alone, and its time next to cuBLAS, weights streamed from HBM;
#  conformance = `tokenmill eval conformance` of a bf16 server on llama-3.1-8b shapes with random
#  weights against the float32 transformers reference: the weights are written once as a
#  checkpoint (`tokenmill eval dummy-checkpoint`, /tmp, 16 GB) that both sides load;
#  startup = issue 24, for qwen3-0.6b and llama-3.1-8b (STARTUP_MODELS): a dummy checkpoint each
#  in /tmp, then benchmarks/startup.py (seconds to the first completion, cold: empty tuning,
#  Triton and inductor caches; warm: the second start; each phase of the api server and of the
#  engine core, which starts beside it; the engine's GEMV tuning and graph capture lines), then
#  benchmarks/long_prompts.py starting warm from those caches: the data workload through HTTP
#  (default options, 256 concurrent) vs LLM.generate, % of the matmul rate, and B6 with
#  8,192-token prompts; the cold starts' GEMV choices exported as shipped choices
#  ($OUT/gemv_defaults/<GPU>.json, scripts/export_gemv_defaults.py). Sized to fit one call:
#  512 data requests on qwen3-0.6b, 128 on llama-3.1-8b (DATA_REQUESTS overrides both), B6 64
#  and 32 prompts (B6_REQUESTS); SERVE_ARGS go to every server, LONG_ARGS to long_prompts.py (a
#  CPU dry run: MODELS=<tiny configs>
#  SERVE_ARGS="--device cpu" LONG_ARGS="--device cpu --length-scale 0.05 --b6-input-len 256"))
#   or TREES="ab/before ab/after" bash scripts/gpu_check.sh [ab-b1|ab-b2]: B1 or B2 without the
#   transformers peer, each source tree in turn, run from inside it (see docs/perf-notes.md);
#   AB_MODELS picks the models (default: qwen3-0.6b llama-3.1-8b)
# Full logs and JSON reports go to $OUT (or ./gpu-out); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The GPU image lacks msgspec, pyzmq, fastapi, setproctitle, ...: carry them as .whl/ (run
# ../shared/device/prep-wheels.sh once, add setproctitle's, which it leaves out: `pip download
# setproctitle --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl`; then `carry: [".whl"]`).
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
out="${OUT:-gpu-out}"
mkdir -p "$out"
what="${1:-all}"
models="${MODELS:-shared/models}"
table="$out/table.txt"
: > "$table"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$table"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$table"

if [[ "$what" == tests || "$what" == all || "$what" == quick || "$what" == gputests ]]; then
  sel=(tests/kernels tests/gpu)
  [[ "$what" == gputests ]] && sel=(tests/gpu tests/kernels tests/engine/test_graph_inputs.py
    tests/engine/test_flashinfer_backend.py -k "gpu or engine or gemv or decode or rope or pdl or flashinfer")
  python3 -m pytest -q -p no:cacheprovider "${sel[@]}" 2>&1 | tee "$out/pytest.log" | tail -25
  echo "tests: $(tail -1 "$out/pytest.log")" >> "$table"
fi

bench() {  # name workload extra-args... (TAG=x: files named <workload>-<name>-x)
  local name=$1 workload=$2 file="$out/$2-$1${TAG:+-$TAG}"; shift 2
  python3 -m tokenmill.entrypoints.cli --log-level WARNING bench offline \
    --config "$models/$name" --workload "$workload" --output "$file.json" "$@" \
    2>&1 | tee "$file.log" | tail -3
  tail -1 "$file.log" >> "$table"
}

kv=(--engine-arg kv_cache_memory_bytes=20000000000)
kv2=(--engine-arg kv_cache_memory_bytes=64000000000)
if [[ "$what" == profile || "$what" == all || "$what" == gputests ]]; then
  for m in qwen3-0.6b llama-3.1-8b; do
    echo "profile $m:" >> "$table"
    python3 benchmarks/profile_decode.py --config "$models/$m" 2>&1 | tee "$out/profile-$m.log" | grep -E "^bs=" >> "$table"
    grep -E "GEMM .*M<=1:" "$out/profile-$m.log" | sed 's/^.*GEMM/  GEMM/' >> "$table"
    grep -E "^timeline" "$out/profile-$m.log" >> "$table"
    grep -m3 -E "^  idle" "$out/profile-$m.log" >> "$table"
    python3 benchmarks/profile_prefill.py --config "$models/$m" 2>&1 | tee "$out/prefill-$m.log" \
      | grep -E "^prefill" >> "$table"
    if [[ "$what" == profile ]]; then  # A/B: the same without programmatic dependent launch
      python3 benchmarks/profile_decode.py --config "$models/$m" --no-pdl 2>&1 \
        | tee "$out/profile-$m-nopdl.log" | grep -E "^no PDL bs=" >> "$table"
    fi
  done
fi
if [[ "$what" == gemv || "$what" == all ]]; then
  python3 benchmarks/gemv_sweep.py --m 1 4 --out "$out/gemv.json" 2>&1 | tee "$out/gemv.log" | grep "M=" >> "$table"
fi
if [[ "$what" == quick ]]; then
  bench qwen3-0.6b b1 --no-peer "${kv[@]}" --engine-arg max_num_seqs=8
fi
if [[ "$what" == b1 || "$what" == all || "$what" == gputests ]]; then
  bench qwen3-0.6b b1 "${kv[@]}" --engine-arg max_num_seqs=8
  bench llama-3.1-8b b1 "${kv[@]}" --engine-arg max_num_seqs=8
fi
if [[ "$what" == b2 || "$what" == all ]]; then
  b2=(--engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192 --engine-arg max_model_len=4096)
  bench qwen3-0.6b b2 "${kv2[@]}" "${b2[@]}"
  bench llama-3.1-8b b2 "${kv2[@]}" "${b2[@]}"
fi
if [[ "$what" == ab-b1 || "$what" == ab-b2 ]]; then
  # A/B of source trees in one call: `python -m` from inside each tree imports that tree's
  # tokenmill (the current directory comes first on sys.path), whatever PYTHONPATH says.
  workload=${what#ab-}
  args=(--engine-arg max_num_seqs=8 "${kv[@]}")
  [[ "$workload" == b2 ]] && args=(--engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192
    --engine-arg max_model_len=4096 "${kv2[@]}")
  abs_models=$(realpath "$models")
  read -ra ab_models <<< "${AB_MODELS:-qwen3-0.6b llama-3.1-8b}"
  for t in ${TREES:?set TREES to the source trees to compare}; do
    for m in "${ab_models[@]}"; do
      log="$out/$workload-$m-$(basename "$t").log"
      (cd "$t" && python3 -m tokenmill.entrypoints.cli --log-level WARNING bench offline \
        --config "$abs_models/$m" --workload "$workload" --no-peer "${args[@]}") > "$log" 2>&1
      echo "$t $m: $(tail -1 "$log")" | tee -a "$table"
    done
  done
fi
if [[ "$what" == moe || "$what" == moetests ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py tests/kernels/test_fused_moe.py \
    tests/gpu/test_engine_gpu.py -k "moe" 2>&1 | tee "$out/pytest-moe.log" | tail -25
  echo "moe tests: $(tail -1 "$out/pytest-moe.log")" >> "$table"
fi
if [[ "$what" == moe || "$what" == moebench ]]; then
  bench qwen3-30b-a3b b1 "${kv[@]}" --engine-arg max_num_seqs=8
  bench qwen3-30b-a3b b2 --engine-arg kv_cache_memory_bytes=40000000000 --engine-arg max_num_seqs=256 \
    --engine-arg max_num_batched_tokens=8192 --engine-arg max_model_len=4096
fi
if [[ "$what" == prefillattn ]]; then
  python3 benchmarks/prefill_attention.py --sweep 2>&1 | tee "$out/prefill-attention.log" \
    | grep -E "TFLOP/s" >> "$table"
  python3 benchmarks/prefill_attention.py --mixed --models qwen3-0.6b 2>&1 \
    | tee "$out/prefill-attention-mixed.log" | grep -E "decode rows" >> "$table"
  python3 benchmarks/prefill_attention.py --decode --sweep 2>&1 \
    | tee "$out/decode-attention.log" | grep -E " batch " >> "$table"
fi
if [[ "$what" == launch ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_launch_gpu.py tests/gpu/test_engine_gpu.py \
    -k "launch or compile" 2>&1 | tee "$out/pytest-launch.log" | tail -3
  echo "launch tests: $(tail -1 "$out/pytest-launch.log")" >> "$table"
  python3 benchmarks/launch_cost.py 2>&1 | tee "$out/launch-cost.log" | grep -E "^launch " >> "$table"
fi
if [[ "$what" == moesweep ]]; then
  python3 benchmarks/moe_sweep.py --config "$models/qwen3-30b-a3b" --out "$out/moe-sweep.json" \
    2>&1 | tee "$out/moe-sweep.log" | grep -E "^T=" >> "$table"
fi
if [[ "$what" == moeprofile ]]; then
  log="$out/profile-qwen3-30b-a3b.log"
  python3 benchmarks/profile_decode.py --config "$models/qwen3-30b-a3b" --batch 1 8 2>&1 | tee "$log" \
    | grep -E "^bs=" >> "$table"
  grep -m15 -E "_kernel|gemm|Memcpy" "$log" | cut -c1-160 >> "$table"
  grep -E "^timeline" "$log" >> "$table"
  grep -m3 -E "^  idle" "$log" >> "$table"
fi
if [[ "$what" == structured || "$what" == all ]]; then
  # B2-like with a JSON schema on every request vs none (host ms per step of each); the
  # grammar's host cost per row; TTFT of a new vs cached schema; step time while schemas compile
  # (benchmarks/structured_outputs.py, with a tokenizer of the model's vocabulary size). Then
  # the host cost per row with session 11's tokenizer (the demo's 8,192 tokens under qwen3's
  # 151,936 ids and EOS: xgrammar's padding cost).
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured_gpu.py 2>&1 | tail -3 >> "$table"
  for m in qwen3-0.6b; do
    python3 benchmarks/structured_outputs.py --config "$models/$m" --output "$out/structured-$m.json" \
      2>&1 | tee "$out/structured-$m.log" | tail -1 >> "$table"
    python3 benchmarks/structured_outputs.py --config "$models/$m" --host-only \
      --tokenizer tokenmill/assets/demo-llama-16m 2>&1 | tail -1 | sed 's/^/demo tokenizer: /' >> "$table"
  done
fi
if [[ "$what" == b4 || "$what" == all ]]; then  # speculative decoding vs plain, same run
  bench qwen3-0.6b b4 "${kv[@]}" --engine-arg max_num_seqs=64 --repeats 3
  bench llama-3.1-8b b4 "${kv[@]}" --engine-arg max_num_seqs=64 --repeats 3
fi
if [[ "$what" == b4adaptive ]]; then  # adaptive speculation at high load vs plain, same run
  bench qwen3-0.6b b4 "${kv[@]}" --engine-arg max_num_seqs=64 --acceptance-rates 0.8,0.6 \
    --batch-sizes 1,64 --adaptive-batch-sizes 1,64 --repeats 3
  bench llama-3.1-8b b4 "${kv[@]}" --engine-arg max_num_seqs=64 --acceptance-rates 0.8 \
    --batch-sizes 1 --adaptive-batch-sizes 1 --repeats 3
  TAG=b64-b256 bench llama-3.1-8b b4 "${kv2[@]}" --engine-arg max_num_seqs=256 \
    --acceptance-rates 0.6 --batch-sizes 64,256 --adaptive-batch-sizes 64,256 --repeats 3
fi
if [[ "$what" == spechost ]]; then  # where a verify step's time goes: host phases vs device
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_gpu.py tests/spec/test_spec_graphs.py 2>&1 \
    | tee "$out/pytest-spec.log" | tail -3 >> "$table"
  for m in qwen3-0.6b llama-3.1-8b; do
    echo "spec_host_time $m batch 1:" >> "$table"
    python3 benchmarks/spec_host_time.py --config "$models/$m" --device cuda --steps 256 \
      --kernels 16 2>&1 | tee "$out/spechost-$m.log" | tail -49 >> "$table"
  done
  echo "spec_host_time llama-3.1-8b batch 1, adaptive:" >> "$table"
  python3 benchmarks/spec_host_time.py --config "$models/llama-3.1-8b" --device cuda --steps 256 \
    --adaptive 2>&1 | tee "$out/spechost-llama-3.1-8b-adaptive.log" | tail -17 >> "$table"
fi
if [[ "$what" == verifyfusion ]]; then
  for probe in spec_host_time verify_fused_gemv; do
    echo "$probe qwen3-0.6b batch 1:" >> "$table"
    XDG_CACHE_HOME="/tmp/tm-$probe" python3 "benchmarks/$probe.py" --config "$models/qwen3-0.6b" \
      --device cuda --steps 256 --kernels 16 2>&1 | tee "$out/$probe.log" | grep -E \
      "M<=8|_ms_per_step|tokens_per_step" >> "$table"
  done
fi
if [[ "$what" == tp ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tee "$out/pytest-tp.log" | tail -5
  echo "tp tests: $(tail -1 "$out/pytest-tp.log")" >> "$table"
  b2=(--engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192 --engine-arg max_model_len=4096)
  for tp in 1 2; do
    peer=(); [[ $tp == 2 ]] && peer=(--no-peer)
    echo "tensor_parallel_size=$tp:" >> "$table"
    bench llama-3.1-8b b1 "${peer[@]}" "${kv[@]}" --engine-arg max_num_seqs=8 --engine-arg tensor_parallel_size=$tp
    bench llama-3.1-8b b2 "${peer[@]}" "${kv2[@]}" "${b2[@]}" --engine-arg tensor_parallel_size=$tp
  done
  bench qwen3-30b-a3b b1 --no-peer "${kv[@]}" --engine-arg max_num_seqs=8 --engine-arg tensor_parallel_size=2
  bench qwen3-30b-a3b b2 --no-peer "${kv2[@]}" "${b2[@]}" --engine-arg tensor_parallel_size=2
fi
if [[ "$what" == hostkv ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_host_kv_gpu.py 2>&1 | tee "$out/pytest-hostkv.log" | tail -5
  echo "hostkv tests: $(tail -1 "$out/pytest-hostkv.log")" >> "$table"
  python3 benchmarks/host_kv_agent.py --config "$models/llama-3.1-8b" --sessions 16 --max-turns 6 \
    --device-kv-tokens 32768 --host-kv-bytes 32000000000 --output "$out/hostkv-llama-3.1-8b.json" \
    2>&1 | tee "$out/hostkv.log" | tail -3
  grep -E "^(without_host_tier|with_host_tier|reload_vs_recompute) " "$out/hostkv.log" >> "$table"
fi
if [[ "$what" == conformance ]]; then
  ckpt="${CONFORMANCE_CKPT:-/tmp/llama-3.1-8b-dummy}" port=8471
  [[ -f "$ckpt/config.json" ]] || python3 -m tokenmill.entrypoints.cli eval dummy-checkpoint \
    --config "$models/llama-3.1-8b" --output "$ckpt" --dtype bfloat16 2>&1 | tail -2
  # KV cache capped: the float32 reference (32 GB) shares the GPU with the server.
  python3 -m tokenmill.entrypoints.cli serve "$ckpt" --port $port --max-model-len 4096 \
    --kv-cache-memory-bytes "${CONFORMANCE_KV_BYTES:-8000000000}" --disable-uvicorn-access-log > "$out/conformance-server.log" 2>&1 &
  server=$!
  python3 -c "
import time, urllib.request
for _ in range(900):
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2); break
    except Exception: time.sleep(1)"
  python3 -m tokenmill.entrypoints.cli eval conformance --base-url "http://127.0.0.1:$port" \
    --model "$ckpt" --output "$out/conformance-llama-3.1-8b.json" \
    --plot "$out/conformance-llama-3.1-8b.png" 2>&1 | tee "$out/conformance.log" | tail -14
  echo "conformance llama-3.1-8b bf16 vs float32:" >> "$table"
  grep -E "^(group|text|token-ids|chat|prefix-hit|all|tokenization|PASS|FAIL)" "$out/conformance.log" >> "$table"
  kill -TERM "$server"; wait "$server"
fi
if [[ "$what" == startup ]]; then
  caches=/tmp/tokenmill-startup-caches
  rm -rf "$caches"
  read -ra startup_models <<< "${STARTUP_MODELS:-qwen3-0.6b llama-3.1-8b}"
  read -ra serve_args <<< "${SERVE_ARGS:-}"
  read -ra long_args <<< "${LONG_ARGS:-}"
  for m in "${startup_models[@]}"; do  # the start-ups first: the issue's first numbers
    ckpt="/tmp/tokenmill-checkpoints/$m"
    if [[ ! -f "$ckpt/config.json" ]]; then
      written=$SECONDS
      python3 -m tokenmill.entrypoints.cli eval dummy-checkpoint --config "$models/$m" \
        --output "$ckpt" > "$out/checkpoint-$m.log" 2>&1 || tail -3 "$out/checkpoint-$m.log"
      echo "dummy checkpoint $m: $(du -sh "$ckpt" | cut -f1) in $((SECONDS - written)) s" >> "$table"
    fi
    timeout -k 20 360 python3 benchmarks/startup.py "$ckpt" --cache-dir "$caches" --log-dir "$out" \
      --timeout 240 --output "$out/startup-$m.json" -- "${serve_args[@]}" 2>&1 \
      | tee "$out/startup-$m.log" | grep -E "^(startup |  cold|  warm|Traceback|\w*Error)" >> "$table"
    for kind in cold warm; do  # the engine core's own lines: what the tuning and capture cost
      grep -hE "GEMV kernel chosen|captured [0-9]+ CUDA graphs" "$out/startup-$m-$kind.log" \
        | sed "s/^/  $m $kind: /" >> "$table" || true
    done
    # The cold tuning's seconds: building and checking the candidates vs timing them.
    awk -v m="$m" '/built and checked in/ {
        for (i = 1; i <= NF; i++) { if ($i == "checked") c += $(i + 2); if ($i == "weights") t += $(i + 2) }
      } END { if (c + t > 0) printf "  %s cold: GEMV tuning builds %.1f s, timing %.1f s\n", m, c, t }' \
      "$out/startup-$m-cold.log" >> "$table"
    # The choices this GPU's tuning made, as shipped choices (come back in $out/gemv_defaults:
    # copy them to tokenmill/assets/gemv_defaults to ship them).
    python3 scripts/export_gemv_defaults.py "$caches/$m/tokenmill/tuning" \
      --output "$out/gemv_defaults" >> "$table" 2>&1
  done
  # What each process's imports cost here (cumulative microseconds, the 12 largest): the api
  # server's (beside which the engine core starts) and the engine core's.
  for mod in tokenmill.entrypoints.api_server tokenmill.engine.core_process; do
    python3 -X importtime -c "import $mod" 2> "$out/importtime-$mod.txt" >/dev/null
    echo "imports of $mod (us, cumulative):" >> "$table"
    sort -t'|' -k2 -n -r "$out/importtime-$mod.txt" | head -12 | cut -d'|' -f2- >> "$table"
  done
  for m in "${startup_models[@]}"; do
    requests=512 prompts=64
    [[ "$m" == llama-3.1-8b ]] && requests=128 prompts=32
    timeout -k 20 360 python3 benchmarks/long_prompts.py "/tmp/tokenmill-checkpoints/$m" --cache-dir "$caches" \
      --log-dir "$out" --num-requests "${DATA_REQUESTS:-$requests}" --b6-requests "${B6_REQUESTS:-$prompts}" \
      --timeout 240 --output "$out/long-prompts-$m.json" "${long_args[@]}" -- "${serve_args[@]}" 2>&1 \
      | tee "$out/long-prompts-$m.log" | grep -E "^(data |B6 |Traceback|\w*Error)" >> "$table"
  done
fi
if [[ "$what" == vl ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_vl_gpu.py 2>&1 | tee "$out/pytest-vl.log" | tail -5
  echo "vl tests: $(tail -1 "$out/pytest-vl.log")" >> "$table"
  python3 benchmarks/vl_images.py --config benchmarks/models/qwen3-vl-30b-a3b --batch 64 --profile \
    --output "$out/vl-qwen3-vl-30b-a3b.json" 2>&1 | tee "$out/vl.log" | tail -3
  grep -E "^(tokenmill|transformers):" "$out/vl.log" >> "$table"
fi
if [[ "$what" == det ]]; then
  # Deterministic mode (issue 30): its GPU tests (each check in a fresh process: cuBLAS reads
  # its split-K setting once), then B1 and B2 without and with it, same engine args, same call.
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_determinism_gpu.py \
    tests/determinism/test_invariant_attention.py 2>&1 | tee "$out/pytest-det.log" | tail -8
  echo "det tests: $(tail -1 "$out/pytest-det.log")" >> "$table"
  # A live server under preemption, with the demo's draft model: two identical bursts.
  python3 scripts/determinism_burst.py --server-arg=--device=cuda 2>&1 | tee "$out/det-burst.log" \
    | tail -1 | sed 's/^/det burst: /' >> "$table"
  b1=(--engine-arg max_num_seqs=8 "${kv[@]}")
  b2=(--engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192
    --engine-arg max_model_len=4096 "${kv2[@]}")
  for m in qwen3-0.6b llama-3.1-8b; do
    for workload in b1 b2; do
      args=("${b1[@]}"); [[ $workload == b2 ]] && args=("${b2[@]}")
      for mode in default deterministic; do
        extra=() cublas=()
        if [[ $mode == deterministic ]]; then
          extra=(--engine-arg deterministic=true)
          # For the cuBLAS products the mode keeps (the torch attention backend's); the engine
          # sets them too, here they are set before the process's first product.
          cublas=(CUBLAS_WORKSPACE_CONFIG=:16:8 CUBLASLT_WORKSPACE_SIZE=1)
        fi
        log="$out/$workload-$m-$mode.log"
        env "${cublas[@]}" python3 -m tokenmill.entrypoints.cli --log-level WARNING bench offline \
          --config "$models/$m" --workload "$workload" --no-peer \
          --output "$out/$workload-$m-$mode.json" "${args[@]}" "${extra[@]}" > "$log" 2>&1
        echo "$mode: $(tail -1 "$log")" | tee -a "$table"
      done
    done
  done
fi
if [[ "$what" == detsweep ]]; then
  python3 benchmarks/invariant_matmul_sweep.py --out "$out/invariant_sweep.json" 2>&1 \
    | tee "$out/invariant_sweep.log" | grep "M=" >> "$table"
fi
echo
echo "=== summary ==="
cat "$table"
