"""Benchmark: what the `verify` stage costs inside `doit generate`, measured in the same run.

    python bench/verify_cost.py [--json OUT] [--recipes R [R ...]]

For each recipe (by default the tiny CPU recipe at world 2, the main Qwen3-MoE recipe at
world 4, the Qwen3-235B-A22B recipe at world 64 and the bench's own Qwen3-235B-A22B recipe
at world 256, whose verify runs the ranks as threads of one process) it copies dodo.py,
recipes/ and bench/recipes/ into a fresh temp project and runs,
each as a subprocess with OMP_NUM_THREADS=1 and WORLD_SIZE/RANK/LOCAL_RANK/MASTER_* removed:

- before: `doit diff config=R`      (resolve → derive → freeze → emit → diff);
- verify: `doit verify config=R`    (verify alone), sampling the total RSS of the doit
  process tree (doit + every descendant) every 0.05 s;
- after:  `doit generate config=R`  (install + preflight);
- no-op:  `doit generate config=R` five more times (median), under a boot that exits 99
  when torch or transformers got imported (tests/project_fixtures.py's NO_TORCH_BOOT).

full = before + verify + after. It prints one row per recipe and the `[verify] ok: ...`
line each verify printed, then the goals:

- the main recipe's verify <= 20 s;
- the 64-rank recipe's end-to-end generate (before + verify + after) <= 90 s, with
  peak total RSS during its verify <= 4096 MiB;
- the 256-rank recipe's end-to-end generate <= 300 s, peak total RSS <= 6144 MiB;
- every recipe's no-op median <= 0.5 s, and no no-op run imports torch/transformers.

A missed goal still exits 0 (it is a benchmark); a failing doit command exits 1 after
printing its output.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hyper_parallel.testing.light_boot import NO_TORCH_BOOT, TORCH_IMPORTED_RC

try:
    import psutil
except ImportError:  # fall back on /proc
    psutil = None

REPO = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny_cpu/qwen3_moe_tiny.yaml"
MAIN = "recipes/qwen3_moe.yaml"
BIG = "recipes/qwen3_235b_64/qwen3_235b_a22b_64.yaml"
HUGE = "bench/recipes/qwen3_235b_256/qwen3_235b_a22b_256.yaml"  # a bench recipe: no committed bundle
RECIPES = [TINY, MAIN, BIG, HUGE]
NOOP_REPEATS = 5
SAMPLE_S = 0.05
GOAL_MAIN_VERIFY_S = 20.0
GOAL_BIG_FULL_S = 90.0
GOAL_BIG_RSS_MIB = 4096.0
GOAL_HUGE_FULL_S = 300.0
GOAL_HUGE_RSS_MIB = 6144.0
GOAL_NOOP_S = 0.5

_TASK_LINE = re.compile(r"^(\.|--)\s+(\w+):(\S+)", re.M)
_VERIFY_OK = re.compile(r"^\s*\[verify\] ok:.*$", re.M)


def bench_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def make_project(root: Path) -> Path:
    project = root / "project"
    project.mkdir()
    shutil.copy(REPO / "dodo.py", project)
    for folder in ("recipes", "bench/recipes"):
        shutil.copytree(REPO / folder, project / folder, ignore=shutil.ignore_patterns("generated", "__pycache__"))
    return project


def _tree_rss_bytes(pid: int) -> int:
    """Sum of VmRSS over ``pid`` and all its descendants (0 once it is gone)."""
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total
    total, todo, seen = 0, [pid], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        try:
            for line in Path(f"/proc/{cur}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{cur}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def run_doit(project: Path, *args: str, no_torch_boot: bool = False,
             sample_rss: bool = False) -> dict:
    """Run doit in ``project``; wall seconds, combined output, rc, and peak tree RSS (MiB)."""
    cmd = [sys.executable, "-c", NO_TORCH_BOOT, *args] if no_torch_boot else [sys.executable, "-m", "doit", *args]
    with tempfile.TemporaryFile(mode="w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=project, env=bench_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
        peak = 0
        if sample_rss:
            while proc.poll() is None:
                peak = max(peak, _tree_rss_bytes(proc.pid))
                time.sleep(SAMPLE_S)
        rc = proc.wait()
        elapsed = time.perf_counter() - start
        out.seek(0)
        output = out.read()
    ran = [m.group(2) for m in _TASK_LINE.finditer(output) if m.group(1) == "."]
    return {"s": elapsed, "rc": rc, "output": output, "ran": ran,
            "peak_rss_mib": peak / 2**20 if sample_rss else None}


def checked(result: dict, what: str, allowed_rc: tuple[int, ...] = (0,)) -> dict:
    if result["rc"] not in allowed_rc:
        print(f"\n`{what}` failed with exit code {result['rc']}:\n{result['output']}", flush=True)
        sys.exit(1)
    return result


def world_of(project: Path, recipe: str) -> int:
    import yaml

    acc = yaml.safe_load((project / recipe).read_text()).get("accelerator", {})
    return int(acc.get("nproc_per_node", 1)) * int(acc.get("nnodes", 1))


def bench_recipe(recipe: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="hp-bench-verify-") as tmp:
        project = make_project(Path(tmp))
        world = world_of(project, recipe)
        print(f"{recipe} (world {world}) ...", flush=True)
        cfg = f"config={recipe}"
        before = checked(run_doit(project, "diff", cfg), f"doit diff {cfg}")
        verify = checked(run_doit(project, "verify", cfg, sample_rss=True), f"doit verify {cfg}")
        after = checked(run_doit(project, "generate", cfg), f"doit generate {cfg}")
        noops = [checked(run_doit(project, "generate", cfg, no_torch_boot=True),
                         f"doit generate {cfg} (no-op, no-torch boot)", (0, TORCH_IMPORTED_RC))
                 for _ in range(NOOP_REPEATS)]
    notes = []
    if "verify" in before["ran"]:
        notes.append("`doit diff` ran verify")
    if "verify" not in verify["ran"]:
        notes.append("`doit verify` did not run verify")
    if "verify" in after["ran"] or not {"install", "preflight"} <= set(after["ran"]):
        notes.append(f"`doit generate` after verify ran {after['ran']} (expected install + preflight)")
    for i, noop in enumerate(noops):
        if noop["ran"]:
            notes.append(f"no-op #{i + 1} ran {noop['ran']}")
    ok_lines = _VERIFY_OK.findall(verify["output"])
    full = before["s"] + verify["s"] + after["s"]
    noop_s = [n["s"] for n in noops]
    return {
        "world": world,
        "before_verify_s": round(before["s"], 3),
        "verify_s": round(verify["s"], 3),
        "after_verify_s": round(after["s"], 3),
        "full_s": round(full, 3),
        "verify_share": round(verify["s"] / full, 3),
        "noop_median_s": round(statistics.median(noop_s), 3),
        "noop_s": [round(s, 3) for s in noop_s],
        "noop_torch_imported": any(n["rc"] == TORCH_IMPORTED_RC for n in noops),
        "verify_peak_rss_mib": round(verify["peak_rss_mib"], 1),
        "verify_line": ok_lines[-1].strip() if ok_lines else None,
        "tasks_ran": {"before": before["ran"], "verify": verify["ran"], "after": after["ran"]},
        "notes": notes,
    }


def goals(rows: dict) -> dict:
    out = {}
    if MAIN in rows:
        v = rows[MAIN]["verify_s"]
        out["main_verify_le_20s"] = {"value": v, "pass": v <= GOAL_MAIN_VERIFY_S,
                                     "text": f"main recipe verify {v:.2f} s <= {GOAL_MAIN_VERIFY_S:.0f} s"}
    for recipe, key, ranks, goal_s, goal_mib in ((BIG, "big_full_le_90s_rss_le_4096mib", 64, GOAL_BIG_FULL_S,
                                                  GOAL_BIG_RSS_MIB),
                                                 (HUGE, "huge_full_le_300s_rss_le_6144mib", 256, GOAL_HUGE_FULL_S,
                                                  GOAL_HUGE_RSS_MIB)):
        if recipe not in rows:
            continue
        full, rss = rows[recipe]["full_s"], rows[recipe]["verify_peak_rss_mib"]
        out[key] = {
            "value": {"full_s": full, "verify_peak_rss_mib": rss},
            "pass": full <= goal_s and rss <= goal_mib,
            "text": (f"{ranks}-rank generate end to end {full:.2f} s <= {goal_s:.0f} s, "
                     f"verify peak total RSS {rss:.0f} MiB <= {goal_mib:.0f} MiB")}
    if rows:
        worst = max(r["noop_median_s"] for r in rows.values())
        slowest = max(s for r in rows.values() for s in r["noop_s"])
        torch = [name for name, r in rows.items() if r["noop_torch_imported"]]
        out["noop_le_0_5s_no_torch"] = {
            "value": {"worst_noop_median_s": worst, "slowest_noop_run_s": slowest, "torch_imported_in": torch},
            "pass": worst <= GOAL_NOOP_S and not torch,
            "text": (f"every no-op median <= {GOAL_NOOP_S} s (worst {worst:.3f} s, slowest single run {slowest:.3f} s) "
                     f"and imports no torch "
                     f"({'imported in ' + ', '.join(torch) if torch else 'none did'})")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--recipes", nargs="+", default=RECIPES, help="recipes to measure (default: the four above)")
    args = parser.parse_args()

    rows = {recipe: bench_recipe(recipe) for recipe in args.recipes}

    header = (f"{'recipe':52s} {'world':>5s} {'before s':>9s} {'verify s':>9s} {'after s':>8s} {'full s':>8s} "
              f"{'verify/full':>11s} {'no-op med s':>11s} {'torch in no-op':>14s} {'verify peak RSS MiB':>19s}")
    print()
    print(header)
    print("-" * len(header))
    for recipe, r in rows.items():
        print(f"{recipe:52s} {r['world']:5d} {r['before_verify_s']:9.2f} {r['verify_s']:9.2f} "
              f"{r['after_verify_s']:8.2f} {r['full_s']:8.2f} {r['verify_share']:11.2f} "
              f"{r['noop_median_s']:11.3f} {'yes' if r['noop_torch_imported'] else 'no':>14s} "
              f"{r['verify_peak_rss_mib']:19.0f}")
    print("\n(peak RSS: total over the `doit verify` process tree, sampled every 0.05 s; the goals use the 64- and "
          "256-rank rows)")
    print("\nverify lines:")
    for recipe, r in rows.items():
        print(f"  {recipe}: {r['verify_line'] or '(no [verify] ok: line found)'}")
    notes = [(recipe, n) for recipe, r in rows.items() for n in r["notes"]]
    if notes:
        print("\nnotes:")
        for recipe, note in notes:
            print(f"  {recipe}: {note}")

    results = goals(rows)
    print("\ngoals:")
    for goal in results.values():
        print(f"  {'PASS' if goal['pass'] else 'FAIL'}  {goal['text']}")
    for recipe, goal in ((MAIN, "main recipe verify"), (BIG, "64-rank end to end + RSS"),
                         (HUGE, "256-rank end to end + RSS")):
        if recipe not in rows:
            print(f"  n/a   {goal} ({recipe} not measured)")
    if args.json:
        Path(args.json).write_text(json.dumps({"recipes": rows, "goals": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
