#!/usr/bin/env bash
# The CUDA checks of one GPU session, as one short script (a few minutes on one H200):
#   1. tests/gpu (fp16/bf16 autocast, GradScaler state and skips, clipping after unscale, accumulation, the
#      host synchronisations per training batch in steady state, per precision);
#   2. the throughput benchmark, deepepochs and the raw loop, fp32/fp16/bf16 (PERF-2);
#   3. the smoke training run on CUDA (checkpoint, resume, test on the best weights);
#   4. the examples that pick the GPU by themselves (one process per GPU, mixed precision, torch.compile,
#      training by updates, weight averaging), each with its exit status in examples.log.
# Everything lands in $OUT (default benchmarks/results/gpu): gpu_checks.json (environment, test summary,
# throughput pairs and their ratios, smoke result), gpu_tests.txt, examples.log and gpu_checks.log. Copy them into
# benchmarks/results/ to record them.
#
# The machine needs torch with CUDA, numpy, attrs, tqdm and tensorboard (the lent H200 image has them)
# and `transitions`, which it lacks: carry it as a wheel. Once, in the repo root:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps transitions==0.9.3 -d .whl
# then run this with `.whl` carried:  bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$OUT/gpu_checks.log") 2>&1

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl \
        && export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
if ! python3 -c "import deepepochs" 2>/dev/null; then
    python3 -c "import deepepochs"
    echo "deepepochs does not import here (see above); carry the missing packages as wheels (header)"
    exit 2
fi
python3 - "$WORK/env.json" <<'EOF'
import json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count()}
json.dump(info, open(sys.argv[1], "w"))
print("environment:", info)
EOF

echo "== tests/gpu"
timeout 300 python3 -m pytest -q -rs tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt"
echo "pytest exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt"

echo "== throughput (deepepochs and raw loop; 20 warm-up + 400 measured steps each)"
# The first run on a fresh machine is slower (clocks and cuDNN's choices settling; seen on an H200: the
# first of six runs was 10 % slower whichever loop it was): one raw run first, its figures discarded.
timeout 150 python3 benchmarks/multigpu_benchmark.py --steps 50 --raw >/dev/null 2>&1 || echo "warm-up run failed"
for precision in fp32 fp16 bf16; do
    for kind in deepepochs raw; do
        flag=$([ "$kind" = raw ] && echo --raw || true)
        timeout 150 python3 benchmarks/multigpu_benchmark.py --precision "$precision" --steps 400 $flag \
            --output "$WORK/throughput-$precision-$kind.json" || echo "failed: $precision $kind"
    done
done

echo "== smoke training on CUDA"
timeout 150 python3 tests/smoke_training.py --device cuda --output "$WORK/smoke" || echo "smoke training failed"

echo "== examples on CUDA"
for example in "01-basic.py" "16-amp.py" "19-compile.py" "21-distributed.py --small" "26-predict.py" \
        "27-lr_find.py" "28-training_by_updates.py --small" "29-weight_averaging.py --small"; do
    echo "== example $example" >>"$OUT/examples.log"
    # shellcheck disable=SC2086  # the example's arguments are split on purpose
    timeout 150 python3 examples/$example >>"$OUT/examples.log" 2>&1
    echo "exit $?: $example" | tee -a "$OUT/examples.log"
done

python3 - "$WORK" "$OUT" <<'EOF'
import glob, json, os, re, sys
work, out_dir = sys.argv[1:]

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"missing": f"{type(e).__name__}: {e}"}

out = {"environment": load(os.path.join(work, "env.json")), "throughput": {}, "ratios": {}}
tests = open(os.path.join(out_dir, "gpu_tests.txt")).read()
summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped).*?)\s*=*$", tests, re.M)
out["gpu_tests"] = summary[-1] if summary else tests.strip().splitlines()[-2:]
for path in sorted(glob.glob(os.path.join(work, "throughput-*.json"))):
    out["throughput"][os.path.basename(path)[len("throughput-"):-len(".json")]] = load(path)
for precision in ("fp32", "fp16", "bf16"):
    ours, raw = out["throughput"].get(f"{precision}-deepepochs", {}), out["throughput"].get(f"{precision}-raw", {})
    key = "global_throughput"
    if key in ours and key in raw:
        out["ratios"][precision] = ours[key] / raw[key]
out["smoke"] = load(os.path.join(work, "smoke", "result.json"))
out["examples"] = re.findall(r"^exit (\d+): (.*)$", open(os.path.join(out_dir, "examples.log")).read(), re.M)
with open(os.path.join(out_dir, "gpu_checks.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
print("throughput deepepochs / raw:", {k: round(v, 4) for k, v in out["ratios"].items()})
print("tests/gpu:", out["gpu_tests"])
EOF
