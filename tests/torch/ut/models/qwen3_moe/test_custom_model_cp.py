"""The custom-backend Qwen3-MoE (``models/common``) under context parallel that splits
attention, against the single-process HF model with the same weights: three AdamW steps,
loss (rtol 1e-5) and every gradient of every step (``cp_custom_backend_worker``), at cp2,
cp4 and tp2+cp2 (with sequence and loss parallel), allgather_kv with and without load
balance, ulysses, GQA, tied embeddings and the experts split over ep (cp2+ep2,
tp2+cp2+ep2); and each rank's attention computed S/cp
queries (allgather_kv) or the whole sequence of heads/(tp*cp) heads (ulysses), so the
work was split. One launch per world size runs its variants in turn."""

import json

import pytest
import yaml

from tests.launch import assert_ran, torchrun
from tests.models.model_helpers import tiny_project_recipe
from tests.project_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ, HEADS, EXPERTS = 16, 4, 4
WORKER = "tests.torch.ut.models.qwen3_moe.cp_custom_backend_worker"


def variant(*, cp, tp=1, sp=0, lp=0, alg="allgather_kv", lb=0, tie=0, kv=2, ep=1) -> str:
    return f"cp={cp}:tp={tp}:sp={sp}:lp={lp}:alg={alg}:lb={lb}:tie={tie}:kv={kv}:ep={ep}"


VARIANTS = {
    2: [variant(cp=2), variant(cp=2, lb=1, tie=1), variant(cp=2, alg="ulysses"), variant(cp=2, ep=2, lb=1)],
    4: [variant(cp=2, tp=2, sp=1, lp=1, lb=1), variant(cp=2, tp=2, alg="ulysses", tie=1, kv=4),
        variant(cp=2, tp=2, ep=2, sp=1, alg="ulysses", kv=4),
        variant(cp=4, lb=1), variant(cp=4, alg="ulysses", kv=4),
        variant(cp=2, tp=2, alg="ulysses")],  # kv heads 2 over tp*cp = 4: refused
}
REFUSED = variant(cp=2, tp=2, alg="ulysses")
# the recipe's accelerator section says the same (tests the recipe -> context_parallel path)
RECIPE_VARIANT = variant(cp=2, lb=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """``{variant: [rank 0's result, rank 1's, ...]}`` of every world size's launch; world 2
    also runs the recipe variant (RECIPE_VARIANT), parallelized as HyperAutoModel does."""
    recipe = tiny_project_recipe(tmp_path_factory.mktemp("project"), codegen=False, modeling_backend="custom")
    data = yaml.safe_load(recipe.read_text())
    data["accelerator"].update(nproc_per_node=2, cp_size=2,
                               context_parallel={"algorithm": "allgather_kv", "load_balance": True})
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    by_variant = {}
    for world, variants in VARIANTS.items():
        variants = variants + ([f"{RECIPE_VARIANT}:recipe={recipe}"] if world == 2 else [])
        out = tmp_path_factory.mktemp(f"world{world}")
        assert_ran(torchrun(["-m", WORKER, "--out", str(out), *variants], cwd=REPO, nproc=world, timeout=400))
        ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
        for name in variants:
            by_variant[name.split(":recipe=")[0] + (":recipe" if ":recipe=" in name else "")] = [
                rank[name] for rank in ranks]
    return by_variant


@pytest.mark.parametrize("name", [v for vs in VARIANTS.values() for v in vs if v != REFUSED]
                         + [f"{RECIPE_VARIANT}:recipe"])
def test_custom_backend_context_parallel_matches_hf(results, name):
    flags = dict(item.split("=") for item in name.removesuffix(":recipe").split(":"))
    cp, tp = int(flags["cp"]), int(flags["tp"])
    for rank, result in enumerate(results[name]):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5), f"rank {rank}"
        assert result["grad_mismatches"] == [], f"rank {rank}"
        assert result["contexts"] > 0, f"rank {rank}: no attention module got a cp context"
        expected = (HEADS // (tp * cp), SEQ) if flags["alg"] == "ulysses" else (HEADS // tp, SEQ // cp)
        assert result["inner_shapes"] == [list(expected)], f"rank {rank}: the attention's (heads, queries)"
        assert result["local_experts"] == EXPERTS // int(flags["ep"]), f"rank {rank}: experts held"


def test_custom_backend_ulysses_refuses_kv_heads_tp_times_cp_does_not_divide(results):
    for result in results[REFUSED]:
        assert "error" in result
        assert ("accelerator.context_parallel.algorithm: ulysses splits the heads over tp_size*cp_size = 4, "
                "but the model's num_key_value_heads is 2") in result["error"]
