#!/usr/bin/env bash
# The one-GPU checks (issue 52) in one script, for a lent GPU machine with its own torch
# (>= 2.11 with CUDA) and no package registry:
#
#   python bench/gpu_wheels.py            # here, first: build/gpu_wheels (carried with the tree)
#   bash bench/gpu_check.sh OUT_DIR       # there: writes its results as JSON under OUT_DIR
#
# 1. installs the carried wheels (transformers, accelerate, doit, pytest and their
#    dependencies torch's environment lacks) with --no-index --no-deps into a folder put on
#    PYTHONPATH, beside this checkout;
# 2. pytest -m gpu (tests/gpu: the trainer at world 1 against HF on the same GPU in fp32 and
#    mixed bf16, compile with activation checkpointing, a checkpoint resume, grouped experts
#    against transformers' grouped_mm, the dry run on the GPU; tp2 on nccl with 2 GPUs);
# 3. bench/gpu_step.py: tokens/s, MFU and peak memory against transformers + Accelerate.
# Each part has a time limit, so the whole stays under 8 minutes and writes what it measured:
# OUT_DIR/summary.json, environment.json, pytest.xml, pytest.log, gpu_step.json, gpu_step.log.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
SITE=$(mktemp -d)/site
if [ -f "$WHEELS/requirements.txt" ]; then
  python -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" \
    -r "$WHEELS/requirements.txt" > "$OUT/install.log" 2>&1 || echo "wheel install failed: see $OUT/install.log"
else
  echo "no $WHEELS/requirements.txt: run python bench/gpu_wheels.py before carrying the tree" | tee "$OUT/install.log"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

python - > "$OUT/environment.json" <<'PY'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for name in ("transformers", "accelerate", "doit", "pytest", "hyper_parallel"):
    try:
        module = __import__(name)
        info[name] = getattr(module, "__version__", module.__file__)
    except Exception as exc:  # reported, the checks go on and say what failed
        info[name] = f"missing: {exc}"
print(json.dumps(info, indent=1))
PY
cat "$OUT/environment.json"

start=$(date +%s)
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
  --junitxml "$OUT/pytest.xml" tests/gpu 2>&1 | tee "$OUT/pytest.log"
pytest_rc=${PIPESTATUS[0]}
timeout 270 python bench/gpu_step.py --steps 8 --warmup 3 --json "$OUT/gpu_step.json" 2>&1 | tee "$OUT/gpu_step.log"
bench_rc=${PIPESTATUS[0]}

python - "$OUT" "$pytest_rc" "$bench_rc" "$start" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path
out, pytest_rc, bench_rc, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tests = {}
if (out / "pytest.xml").exists():
    for case in ET.parse(out / "pytest.xml").iter("testcase"):
        status = "failed" if case.find("failure") is not None or case.find("error") is not None \
            else "skipped" if case.find("skipped") is not None else "passed"
        tests[f"{case.get('classname')}::{case.get('name')}"] = status
bench = json.loads((out / "gpu_step.json").read_text()) if (out / "gpu_step.json").exists() else None
summary = {"pytest_rc": pytest_rc, "gpu_step_rc": bench_rc, "seconds": round(time.time() - start),
           "tests": tests, "counts": {s: list(tests.values()).count(s) for s in ("passed", "failed", "skipped")},
           "gpu_step": bench}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary["counts"]), f"pytest exit {pytest_rc}, gpu_step exit {bench_rc}, {summary['seconds']}s")
PY
[ "$pytest_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
