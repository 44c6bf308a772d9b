#!/usr/bin/env bash
# The GPU run, on the lent NVIDIA machine (device tool), from the repository root:
#
#     . .gpu/prologue.sh || exit 1; bash .ci/gpu_run.sh PHASE...
#
# with `carry: [".gpu", ".whl", ".gl"]` (fill them here first: bash ../shared/gpu/fetch.sh,
# plus the pytest-xdist and execnet wheels in .whl, see below). PHASEs, run in order:
#   build   compile the Cython core in place (the image has Cython and setuptools; offline)
#   probe   list the devices zyx finds and run one realization on each
#   smoke   the backend test files (CUDA, OpenCL, lowering, devices) on the GPU
#   cuda    the whole test suite with the CUDA device as the default device
#   opencl  the whole test suite with OpenCL (NVIDIA's) as the default device
#   vulkan  the whole test suite with Vulkan (NVIDIA's driver) as the default device (f16 and
#           bf16 included; spirv-val off for speed: tests/test_spirv.py validates), then
#           benches/bench_vk.py on vulkan (torch CUDA beside it)
#   wgpu    the whole test suite with WebGPU (wgpu-py through Vulkan) as the default device
#   bench   benches/bench_gpu.py through benches/report.py (markdown table)
#   base    the same benchmarks (BENCH_K too) on another checkout, for before/after
#           figures in one run: BASE_TREE names a folder holding it (e.g. made here with
#           `mkdir -p .base && git archive REV | tar -x -C .base`, carried), built in place
#   opencl-cache  test_fusion, test_backend_trust, test_opencl with OpenCL as the default
#   profile benches/gpu_launch_profile.py: where a tiny realization's host time goes (CUDA)
#   sweep   benches/gpu_elementwise_sweep.py: the elementwise lowering's variants (ZYX_GPU_EW)
#   rows    benches/gpu_rows_sweep.py: the group lowering's variants on softmax, log_softmax
#           and layer_norm (ZYX_GPU_GROUP), PyTorch beside them
#   gemm    benches/gpu_gemm_sweep.py: the gemm lowering's variants and tiles (ZYX_GPU_GEMM,
#           GEMM_VARIANTS: space-separated, default the script's) on matmul and conv2d
#   shapes  benches/gpu_shapes.py: matmuls and convolutions beyond issue 13's shapes against
#           torch (SHAPES_VARIANTS: space-separated ZYX_GPU_GEMM values or "plain-input")
#   nccl    tests/test_distributed.py on the GPU: NCCL with world size 1 (communicator, every
#           collective, a DDP step, the watchdog's tracking), the rest of the file beside it
#           (mpirun cases skip without Open MPI and mpi4py; two-GPU cases without two
#           GPUs); then benches/dist_nccl_step.py (the MNIST convnet step plain and in DDP)
#           and, with two GPUs, benches/dist_nccl_overlap.py (DDP's all-reduces overlapping
#           the backward or not)
#   tune    benches/bench_tuning.py on CUDA: the MNIST convnet step with heuristic and with
#           autotuned schedules, and the time the search took; then tests/test_tuning.py
#   vkbench benches/bench_vk.py on cuda:0, vulkan:0 and wgpu:0 (issue 30's cases)
#   vksteps the training steps on Vulkan and WebGPU beside zyx CUDA: benches/gpu_replay_ab.py
#           (plan launches on and off, AB_ROUNDS rounds, default 5), the host time of a
#           50-kernel plan (benches/gpu_plan_launch.py) on each, and the MLP SGD and Adam
#           steps' kernels launched alone on wgpu:0 and vulkan:0 (gpu_step_profile.py --mlp)
#   vksweep benches/gpu_vk_bandwidth_sweep.py on vulkan and wgpu: the SPIR-V and WGSL
#           lowering knobs over the memory-bound cases (VKSWEEP_VARIANTS: substrings
#           choosing variants)
#   coopmat tests/test_vulkan_coopmat.py on the GPU (VK_KHR_cooperative_matrix products
#           against numpy and the float tiles), then benches/gpu_vk_coopmat.py: float16 and
#           bfloat16 matmuls 1024-4096 beside torch (COOPMAT_VARIANTS: the script's
#           variants, e.g. "sweep"; default "default off")
#   suites  the tests of each backend of SUITES (default "cuda vulkan wgpu"; -k BACKEND,
#           SUITE_ALL=1 the whole suite) with it as the default device, all at once
#   recipes benches/bench_recipes.py on CUDA (issue 31's recipes, torch CUDA beside them:
#           zyx/torch ratios), then tests/test_bounds.py with CUDA as the default device
#   firststep benches/first_step.py: the first training step of a fresh process, empty
#           caches, zyx on CUDA beside PyTorch eager and torch.compile (reduce-overhead)
#   jit     benches/bench_jit.py: the recipe convnet and LM steps with and without
#           zyx.jit, beside PyTorch eager and torch.compile (reduce-overhead)
#   stepprofile benches/gpu_step_profile.py --recipe --torch: the recipe steps' kernels
#           one by one, and PyTorch's from torch.profiler
#   kvcache benches/bench_kv_cache.py on CUDA with caches of KV_CONTEXTS positions (default
#           "1024 8192"): the write into the caches' memory forced, the functional update,
#           PyTorch eager (issue 31's key/value cache; GPUs default to the functional
#           update below 64 MiB caches)
#   tf32ab  benches/bench_jit.py --only mnist with zyx's convolutions on TF32 (the default,
#           zyx.backends.cudnn.allow_tf32) and in float32 (ZYX_CONV_TF32=0), one process each
# SUITE_TIMEOUT (seconds, default 540) bounds each whole-suite phase.
# Logs go to $OUT (the device tool brings them back) and the summary lines to stdout.
# pytest-xdist spreads the suites over the machine's cores when its wheel was carried:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl pytest-xdist execnet
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/zyx-gpu-out}
mkdir -p "$OUT"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/zyx-cache}
# zyx is built in place, not installed: scripts and the tests' child processes import it
# from here
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=python3
XDIST=()
if $PY -c "import xdist" 2>/dev/null; then XDIST=(-n 12); fi

summary() {  # name logfile: print pytest's last line
    echo "$1: $(grep -E '(passed|failed|error)' "$2" | tail -1)"
}

for phase in "$@"; do
    t0=$(date +%s)
    case "$phase" in
    build)
        $PY setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
        ;;
    probe)
        ZYX_DEBUG=1 $PY - <<'EOF' 2>&1 | tee "$OUT/probe.log"
import numpy as np, zyx
for d in zyx.devices():
    x = zyx.tensor(np.arange(8, dtype=np.float32), device=str(d))
    print(repr(d), "->", ((x * 2).sum()).item())
print("default:", zyx.get_default_device())
EOF
        ;;
    smoke)
        files=()
        for f in tests/test_cuda.py tests/test_opencl.py tests/test_gpu_lowering.py \
                 tests/test_gemm.py tests/test_devices.py tests/test_dlpack.py; do
            [ -f "$f" ] && files+=("$f")
        done
        $PY -m pytest -q -p no:cacheprovider -rs "${files[@]}" >"$OUT/smoke.log" 2>&1
        summary smoke "$OUT/smoke.log"
        grep -E "^(FAILED|ERROR)" "$OUT/smoke.log" | head -20
        ;;
    cuda|opencl|wgpu)
        ZYX_DEVICE=$phase timeout "${SUITE_TIMEOUT:-540}" $PY -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
            -x --maxfail=30 tests >"$OUT/suite-$phase.log" 2>&1
        summary "suite on $phase" "$OUT/suite-$phase.log"
        grep -E "^(FAILED|ERROR)" "$OUT/suite-$phase.log" | head -30
        ;;
    vulkan)
        ZYX_DEVICE=vulkan ZYX_SPIRV_VALIDATE=0 timeout "${SUITE_TIMEOUT:-540}" $PY -m pytest -q \
            -p no:cacheprovider "${XDIST[@]}" --maxfail=30 tests >"$OUT/suite-vulkan.log" 2>&1
        summary "suite on vulkan" "$OUT/suite-vulkan.log"
        grep -E "^(FAILED|ERROR)" "$OUT/suite-vulkan.log" | head -30
        $PY benches/bench_vk.py vulkan >"$OUT/bench-vulkan.md" 2>"$OUT/bench-vulkan.err"
        cat "$OUT/bench-vulkan.md"; tail -5 "$OUT/bench-vulkan.err"
        ;;
    bench)
        # BENCH_K: a pytest -k expression choosing some of the benchmarks
        $PY benches/report.py benches/bench_gpu.py ${BENCH_K:+-k "$BENCH_K"} \
            >"$OUT/bench.md" 2>"$OUT/bench.err"
        cat "$OUT/bench.md"
        ;;
    base)
        [ -f "${BASE_TREE:-}/setup.py" ] || { echo "base: BASE_TREE must name a checkout"; exit 2; }
        (cd "$BASE_TREE" && $PY setup.py build_ext --inplace -q) >"$OUT/base-build.log" 2>&1 \
            || { tail -30 "$OUT/base-build.log"; exit 1; }
        # this checkout's benchmark scripts, the other checkout's zyx (first on the path)
        PYTHONPATH=$(cd "$BASE_TREE" && pwd):$PYTHONPATH $PY benches/report.py \
            benches/bench_gpu.py ${BENCH_K:+-k "$BENCH_K"} >"$OUT/bench-base.md" 2>"$OUT/bench-base.err"
        cat "$OUT/bench-base.md"
        ;;
    coopmat)
        $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_coopmat.py \
            >"$OUT/coopmat.log" 2>&1
        summary "coopmat tests" "$OUT/coopmat.log"
        grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/coopmat.log" | head -20
        $PY benches/gpu_vk_coopmat.py vulkan:0 ${COOPMAT_VARIANTS:-} >"$OUT/coopmat.md" \
            2>"$OUT/coopmat.err"
        cat "$OUT/coopmat.md"; tail -5 "$OUT/coopmat.err"
        ;;
    gemm)
        $PY benches/gpu_gemm_sweep.py ${GEMM_VARIANTS:-} >"$OUT/gemm.txt" 2>&1
        cat "$OUT/gemm.txt"
        ;;
    shapes)
        $PY benches/gpu_shapes.py ${SHAPES_VARIANTS:-} >"$OUT/shapes.txt" 2>&1
        grep "^|" "$OUT/shapes.txt"
        ;;
    rows)
        $PY benches/gpu_rows_sweep.py >"$OUT/rows.txt" 2>&1
        cat "$OUT/rows.txt"
        ;;
    nccl)
        $PY -m pytest -q -p no:cacheprovider -rs tests/test_distributed.py >"$OUT/nccl.log" 2>&1
        summary nccl "$OUT/nccl.log"
        grep -E "^(FAILED|ERROR)|nccl|NCCL" "$OUT/nccl.log" | head -20
        # what DDP over NCCL adds to the MNIST convnet step (world size 1)
        $PY benches/dist_nccl_step.py --rounds 7 --steps 20 >"$OUT/nccl-step.log" 2>&1
        grep -E "^\||MNIST|skipped|Error" "$OUT/nccl-step.log" | head -12
        # DDP over two GPUs, its bucket all-reduces overlapping the backward or not
        # (skipped on a machine of one GPU)
        $PY benches/dist_nccl_overlap.py --gpus 2 --rounds 7 --steps 10 \
            >"$OUT/nccl-overlap.log" 2>&1
        grep -E "^\||MLP|skipped|Error" "$OUT/nccl-overlap.log" | head -12
        ;;
    tune)
        ZYX_DEVICE=cuda $PY -m pytest benches/bench_tuning.py --benchmark-only -s -q \
            -p no:cacheprovider --benchmark-columns=min,median,max,rounds \
            >"$OUT/tune.log" 2>&1
        grep -E "zyx autotune|convnet_step|passed|failed|Error" "$OUT/tune.log" | tail -30
        ZYX_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/test_tuning.py \
            >"$OUT/tune-tests.log" 2>&1
        summary "tuning tests on cuda" "$OUT/tune-tests.log"
        grep -E "^(FAILED|ERROR)" "$OUT/tune-tests.log" | head -10
        ;;
    recipes)
        ZYX_DEVICE=cuda $PY -m pytest benches/bench_recipes.py --benchmark-only -s -q \
            -p no:cacheprovider -p no:randomly --benchmark-columns=min,median,max,rounds \
            >"$OUT/recipes.log" 2>&1
        grep -E "zyx/torch|LM script|plans_built|passed|failed|Error" "$OUT/recipes.log" | tail -30
        ZYX_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider -p no:randomly \
            tests/test_bounds.py >"$OUT/bounds-tests.log" 2>&1
        summary "test_bounds on cuda" "$OUT/bounds-tests.log"
        grep -E "^(FAILED|ERROR)" "$OUT/bounds-tests.log" | head -10
        ;;
    firststep)
        # the first training step of a fresh process with empty caches: zyx on CUDA,
        # PyTorch eager and torch.compile(mode="reduce-overhead") (issue 31)
        $PY benches/first_step.py --device cuda --timeout 240 >"$OUT/firststep.md" \
            2>"$OUT/firststep.err"
        cat "$OUT/firststep.md"; grep -E "Error|error" "$OUT/firststep.err" | tail -3
        ;;
    opencl-cache)
        # the tests of the disk caches and of the C backend, with OpenCL as the default
        ZYX_DEVICE=opencl $PY -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
            tests/test_fusion.py tests/test_backend_trust.py tests/test_opencl.py \
            >"$OUT/opencl-cache.log" 2>&1
        summary "opencl cache tests" "$OUT/opencl-cache.log"
        grep -E "^(FAILED|ERROR)" "$OUT/opencl-cache.log" | head -30
        ;;
    sweep)
        # the elementwise lowering's variants (ZYX_GPU_EW) against torch's copy bandwidth
        $PY benches/gpu_elementwise_sweep.py >"$OUT/sweep.log" 2>"$OUT/sweep.err"
        cat "$OUT/sweep.log"; tail -5 "$OUT/sweep.err"
        ;;
    jit)
        # the recipe steps with and without zyx.jit, beside PyTorch eager and
        # torch.compile(mode="reduce-overhead") (issue 31)
        for only in mnist lm; do
            timeout 200 $PY benches/bench_jit.py cuda --steps 30 --compile --only $only \
                >"$OUT/jit-$only.log" 2>&1
            grep -vE "^\s*$|Warning|warn" "$OUT/jit-$only.log" | tail -8
        done
        ;;
    kvcache)
        for n in ${KV_CONTEXTS:-1024 8192}; do
            KV_CONTEXT=$n ZYX_DEVICE=cuda timeout 150 $PY -m pytest benches/bench_kv_cache.py \
                --benchmark-only -q -p no:cacheprovider \
                --benchmark-columns=min,median,max,rounds >"$OUT/kv-$n.log" 2>&1
            echo "key/value caches of $n positions:"
            grep -E "test_kv|passed|failed|Error" "$OUT/kv-$n.log" | tail -5
        done
        ;;
    tf32ab)
        for tf in 1 0; do
            ZYX_CONV_TF32=$tf timeout 150 $PY benches/bench_jit.py cuda --steps 30 --only mnist \
                >"$OUT/tf32-$tf.log" 2>&1
            echo "ZYX_CONV_TF32=$tf:"
            grep -E "ms$|Error" "$OUT/tf32-$tf.log" | tail -5
        done
        ;;
    stepprofile)
        # where the recipe steps' GPU time goes: zyx's kernels one by one, PyTorch's
        # kernels from torch.profiler for the same steps
        $PY benches/gpu_step_profile.py cuda --recipe --torch >"$OUT/stepprofile.log" 2>&1
        cat "$OUT/stepprofile.log" | head -120
        ;;
    profile)
        $PY benches/gpu_launch_profile.py cuda >"$OUT/profile.log" 2>&1
        head -40 "$OUT/profile.log"
        ;;
    vkbench)
        # issue 30's table: benches/bench_vk.py on zyx CUDA, Vulkan and WebGPU in turn
        # (PyTorch CUDA beside each), one markdown table per device
        # (file names without the device's colon: the device tool does not return those)
        for d in cuda:0 vulkan:0 wgpu:0; do
            timeout 240 $PY benches/bench_vk.py "$d" >"$OUT/vk-${d%%:*}.md" 2>"$OUT/vk-${d%%:*}.err"
            cat "$OUT/vk-${d%%:*}.md"; grep -E "Error|error" "$OUT/vk-${d%%:*}.err" | tail -3
        done
        ;;
    vksteps)
        AB_ROUNDS=${AB_ROUNDS:-5} timeout 200 $PY benches/gpu_replay_ab.py wgpu:0 vulkan:0 cuda:0 \
            >"$OUT/vksteps-ab.log" 2>&1
        grep -v XDG "$OUT/vksteps-ab.log"
        for d in wgpu:0 vulkan:0 cuda:0; do
            timeout 60 $PY benches/gpu_plan_launch.py "$d" 1000 2>&1 | grep -v XDG \
                | tee -a "$OUT/vksteps-launch.log"
        done
        for d in wgpu:0 vulkan:0; do
            timeout 90 $PY benches/gpu_step_profile.py "$d" --mlp >"$OUT/vksteps-mlp-${d%%:*}.log" 2>&1
            grep -E "step|plan|alone|outputs 3" "$OUT/vksteps-mlp-${d%%:*}.log" | head -30
        done
        ;;
    vksweep)
        for b in vulkan wgpu; do
            # shellcheck disable=SC2086
            timeout 280 $PY benches/gpu_vk_bandwidth_sweep.py "$b" ${VKSWEEP_VARIANTS:-} \
                >"$OUT/vksweep-$b.md" 2>"$OUT/vksweep-$b.err"
            cat "$OUT/vksweep-$b.md"; grep -E "Error|error" "$OUT/vksweep-$b.err" | tail -3
        done
        ;;
    suites)
        # the device-parametrized suite on several backends at once (SUITES, default
        # "cuda vulkan wgpu"; one GPU, 16 cores: they share it, 12 xdist workers split
        # between them): each run has only its own devices in the `device` fixture
        # (ZYX_TEST_DEVICES) and selects the tests whose names or ids name its backend
        # (-k; SUITE_ALL=1: every test, the CPU-only ones too), bounded by SUITE_TIMEOUT
        # (SIGINT: pytest still prints what ran)
        read -r -a suites <<<"${SUITES:-cuda vulkan wgpu}"
        n=$(( 12 / ${#suites[@]} )); $PY -c "import xdist" 2>/dev/null || n=0
        XD=(); [ "$n" -gt 1 ] && XD=(-n "$n")
        for d in "${suites[@]}"; do
            K=(-k "$d"); [ "${SUITE_ALL:-0}" = 1 ] && K=()
            ZYX_DEVICE=$d ZYX_TEST_DEVICES=$d ZYX_SPIRV_VALIDATE=0 \
                timeout -s INT "${SUITE_TIMEOUT:-540}" $PY -m pytest -q \
                -p no:cacheprovider "${XD[@]}" "${K[@]}" --maxfail=30 tests \
                >"$OUT/suite-$d.log" 2>&1 &
        done
        wait
        for d in "${suites[@]}"; do
            summary "suite on $d" "$OUT/suite-$d.log"
            grep -E "^(FAILED|ERROR)" "$OUT/suite-$d.log" | head -15
        done
        ;;
    *)
        echo "unknown phase $phase"; exit 2 ;;
    esac
    echo "[$phase: $(( $(date +%s) - t0 )) s]"
done
