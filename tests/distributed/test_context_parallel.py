"""Context parallel that splits attention (``accelerator.context_parallel``): allgather_kv
with and without load balance, at cp2 and tp2+cp2, eager and sdpa, GQA, tied embeddings,
equals the single-process HF model (fp32: loss of three AdamW steps rtol 1e-5, every
gradient rtol 1e-4 / atol 1e-6), and the attention function really sees S/cp queries."""

import json
import math

import pytest
import torch

from hyper_parallel.distributed.context_parallel import SequenceOrder, balanced_order
from tests.launch import assert_ran, torchrun
from tests.project_fixtures import REPO

SEQ = 16
# id: (world, worker flags)
CASES = {
    "cp2_sdpa": (2, ["--cp", "2", "--attn", "sdpa"]),
    "cp2_sdpa_balanced": (2, ["--cp", "2", "--attn", "sdpa", "--load-balance"]),
    "cp2_eager_balanced": (2, ["--cp", "2", "--attn", "eager", "--load-balance"]),
    "cp2_eager_tied_balanced": (2, ["--cp", "2", "--attn", "eager", "--load-balance", "--family", "llama"]),
    "tp2_cp2_sdpa_balanced": (4, ["--cp", "2", "--tp", "2", "--attn", "sdpa", "--load-balance"]),
    "tp2_cp2_eager": (4, ["--cp", "2", "--tp", "2", "--attn", "eager"]),
}


def run_worker(world: int, flags: list[str], out) -> list[dict]:
    run = torchrun(["-m", "tests.distributed.context_parallel_worker", "--out", str(out), "--seq-len", str(SEQ),
                    *flags], cwd=REPO, nproc=world, timeout=300)
    assert_ran(run)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_allgather_kv_matches_single_process(case, tmp_path):
    world, flags = CASES[case]
    balanced = "--load-balance" in flags
    for result in run_worker(world, flags, tmp_path):
        assert result["context_parallel"] == {"algorithm": "allgather_kv", "load_balance": balanced}
        assert "kv_gathered_attention" in result["roles"] and "attention_block" not in result["roles"]
        assert result["grad_failures"] == [], result["grad_failures"]
        assert result["grads_checked"] == result["param_count"] > 0
        ref, par = result["losses"]["reference"], result["losses"]["parallel"]
        assert len(par) == 3 and par[2] < par[0]
        for ours, theirs in zip(par, ref):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (par, ref)
        # the attention work is split: every call saw this rank's S/cp queries only
        assert result["attention_blocks"] == 2
        assert result["query_lengths"] == [SEQ // 2]
        assert result["attention_calls"] >= 2 * 3
        assert result["attn_implementation"].startswith("hyper_cp_")
        assert not result["reference_attn_implementation"].startswith("hyper_cp_")
        assert result["local_logits_shape"] == [2, SEQ // 2, 128]  # logits stay split into the sharded loss


@pytest.mark.slow
@pytest.mark.distributed
def test_gather_sequence_keeps_whole_sequence_attention(tmp_path):
    """The explicit baseline: the block gathers its input, no attention wrapper is installed."""
    for result in run_worker(2, ["--cp", "2", "--algorithm", "gather_sequence", "--load-balance"], tmp_path):
        assert result["context_parallel"] == {"algorithm": "gather_sequence", "load_balance": False}
        assert "attention_block" in result["roles"]
        assert result["attention_blocks"] == 0
        assert result["grad_failures"] == []
        assert math.isclose(result["losses"]["parallel"][0], result["losses"]["reference"][0], rel_tol=1e-5)


def test_balanced_order_gives_rank_r_chunks_r_and_mirror():
    order = balanced_order(16, 2)  # chunks of 4: rank 0 holds c0, c3; rank 1 holds c1, c2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    sequence = SequenceOrder(2)
    x = torch.arange(16).view(1, 16)
    assert torch.equal(sequence.restore(sequence.permute(x)), x)
    assert sequence.local_positions(16, 1, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_balanced_order_refuses_indivisible_length():
    with pytest.raises(ValueError, match=r"sequence length 10 must be divisible by 2\*cp_size = 4.*load_balance"):
        balanced_order(10, 2)
