"""A rank that stops (SIGSTOP) during verify: the run fails within the recipe's
accelerator.check_timeout_s (plus a few seconds), names that rank and the last phase it
reported, leaves no process of the run behind, and installs nothing."""

import subprocess
import time

import yaml

from tests.project_fixtures import REPO, TINY_RECIPE, bundle_bytes, cli

TIMEOUT_S = 10


def test_a_stopped_rank_is_named_within_the_timeout(project):
    recipe = project / TINY_RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"]["check_timeout_s"] = TIMEOUT_S
    data["model"]["trusted_modules"] = ["tests.verify"]
    data["plan_overrides"] = [{"match": "*.self_attn.o_proj",
                               "replace_module": {"_target_": "tests.verify.broken_replacements.stop_rank_1"}}]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    bundle = recipe.parent / "generated"
    before = bundle_bytes(bundle) if bundle.is_dir() else {}

    start = time.monotonic()
    proc = cli(project, "generate", "--skip-preflight", "--config", str(recipe), env={"PYTHONPATH": str(REPO)})
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank(s) 1 went silent (last phase reported: rank 1: 'building the probe model')" in out, out
    assert f"after {TIMEOUT_S}s (accelerator.check_timeout_s)" in out, out
    assert seconds < 60 + TIMEOUT_S, seconds  # generate itself (derive) takes seconds; no 900 s launch timeout
    assert (bundle_bytes(bundle) if bundle.is_dir() else {}) == before
    # No rank of this run is left, stopped or not (other runs' ranks may be alive).
    leftovers = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout.splitlines()
    stopped = [line for line in leftovers if line.startswith("T") and "verify_worker" in line]
    assert stopped == [], stopped
