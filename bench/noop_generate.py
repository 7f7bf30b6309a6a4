"""Benchmark: a no-op `doit generate` against a full generation, measured in the same run,
in place and after a CI-style restore.

    python bench/noop_generate.py [--recipe recipes/qwen3_moe.yaml | --recipe all] [--repeats 7] [--json OUT]

Copies dodo.py and recipes/ into a temp folder, runs one full generation (every stage,
through the torchrun preflight), then repeats `doit generate` with nothing changed. Then
copies the whole checkout, workspace included, to another path with new mtimes (what CI
does when it restores the workspace from its cache into a fresh clone) and repeats the
no-op there; the first run after the restore rehashes the files whose mtime changed.
Goals: no-op median <= 0.5 s and >= 10x faster than the full generation; after the
restore, <= 0.5 s per recipe (the first run included).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hyper_parallel.codegen.spec.project import project_recipes

REPO = Path(__file__).resolve().parents[1]


def timed_doit(project: Path, *args: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "doit", *args], cwd=project, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"doit {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/qwen3_moe.yaml",
                        help="a recipe path, or `all` for every recipe under recipes/ (what CI generates)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    selection = [] if args.recipe == "all" else [f"config={args.recipe}"]
    with tempfile.TemporaryDirectory(prefix="hp-bench-") as tmp:
        project = Path(tmp) / "project"
        project.mkdir()
        shutil.copy(REPO / "dodo.py", project)
        shutil.copytree(REPO / "recipes", project / "recipes", ignore=shutil.ignore_patterns("generated"))
        recipes = len(project_recipes(project)) if args.recipe == "all" else 1
        print(f"full generation of {args.recipe} (all stages, torchrun preflight included) ...", flush=True)
        full = timed_doit(project, "generate", *selection)
        noops = [timed_doit(project, "generate", *selection) for _ in range(args.repeats)]
        restored = Path(tmp) / "elsewhere" / "clone"
        shutil.copytree(project, restored, copy_function=shutil.copy)  # new path, new mtimes
        after_restore = [timed_doit(restored, "generate", *selection) for _ in range(args.repeats)]

    median = statistics.median(noops)
    first, restored_median = after_restore[0], statistics.median(after_restore)
    per_recipe = max(first, restored_median) / recipes
    figures = {"recipe": args.recipe, "recipes": recipes, "full_s": round(full, 3), "noop_median_s": round(median, 3),
               "noop_min_s": round(min(noops), 3), "noop_max_s": round(max(noops), 3),
               "speedup": round(full / median, 1), "restored_first_s": round(first, 3),
               "restored_median_s": round(restored_median, 3), "restored_per_recipe_s": round(per_recipe, 3),
               "goal_noop_s": 0.5, "goal_speedup": 10, "goal_restored_per_recipe_s": 0.5}
    print(f"full generation : {full:8.2f} s")
    print(f"no-op (median)  : {median:8.3f} s  over {args.repeats} runs "
          f"(min {min(noops):.3f}, max {max(noops):.3f})")
    print(f"speedup         : {full / median:8.1f}x   goal: no-op <= 0.5 s and >= 10x "
          f"-> {'met' if median <= 0.5 and full / median >= 10 else 'NOT met'}")
    print(f"after a restore : first {first:.3f} s, median {restored_median:.3f} s for {recipes} recipe(s): "
          f"{per_recipe:.3f} s per recipe   goal: <= 0.5 s -> {'met' if per_recipe <= 0.5 else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
