"""torchrun worker: context parallel (``accelerator.context_parallel``) on a tiny
decoder (Qwen3: q/k norms, GQA; Llama with tied embeddings; or Qwen3-MoE, for experts
over ep) vs the single-process HF model with the same weights.

Run from the repo root::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.context_parallel_worker \
        --out OUT_DIR --cp 2 --algorithm allgather_kv --load-balance --attn sdpa

Every rank builds the reference model, plans a copy on the meta device, writes the plan
document (with its ``context_parallel`` key) as JSON, reads it back and applies it the
way a generated file does (``runtime.hyper_parallelize``), trains three AdamW steps on
both and writes ``OUT_DIR/rank<N>.json``: losses, every gradient compared, and the
local query lengths the attention function saw.

``--cases FILE`` runs several layouts in turn in the same processes (one launch instead
of one per layout; every layout of a batch has the same world size): FILE is a JSON
object ``{name: [flags...]}``; every rank runs every layout in the file's order, each on
a fresh mesh and fresh models, and writes ``OUT_DIR/<name>/rank<N>.json``. A layout that
raises writes ``OUT_DIR/<name>/error_rank<N>.txt`` (its traceback) and ends the rank
with exit code 1 (its peers may be inside a collective it will never join), so the
layouts after it have no results and the test names the one that failed.
"""

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from hyper_parallel.config.layout import Layout
from hyper_parallel.runtime import hyper_parallelize
from hyper_parallel.config.context_parallel import ContextParallel
from hyper_parallel.distributed.context_parallel import CONTEXT_ATTRIBUTE
from hyper_parallel.distributed.mesh import MeshContext, ParallelDims, build_device_mesh
from hyper_parallel.distributed.plan_format import plan_to_json
from hyper_parallel.planning.planner import ShardingPlanner
from tests.batch_worker import run_cases
from tests.distributed.tp_equivalence_worker import train_steps
from tests.rank_exit import leave_after_barrier

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 128, 64, 4, 2, 16, 2


def tiny_config(family: str, attn: str, kv_heads: int = KV_HEADS):
    """A two-layer model small enough for CPU, with GQA (4 query heads, 2 kv heads)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                  max_position_embeddings=256, attention_dropout=0.0)
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3Config(**common, tie_word_embeddings=False)
    config._attn_implementation = attn
    return config


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=argv is None)
    parser.add_argument("--cases", help="JSON file {name: [flags...]}: run these layouts in turn")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--algorithm", default="allgather_kv")
    parser.add_argument("--load-balance", action="store_true")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fused", action="store_true", help="the project's fused attention replacement")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    return parser.parse_args(argv)


def fused(model):
    """Every attention replaced by the project's fused attention (the recipe's
    ``replace_module: replace_qwen3_moe_flash_attention``), on the reference too."""
    from hyper_parallel.runtime import hyper_apply_replacements

    target = "hyper_parallel.models.qwen3_moe.adapter.replacements.replace_qwen3_moe_flash_attention"
    hyper_apply_replacements(model, [{"match": "model.layers.*.self_attn", "target": target}])
    return model


def main() -> None:
    args = parse_args()
    if args.cases is None:
        out = run_layout(args)
        Path(args.out, f"rank{out['rank']}.json").write_text(json.dumps(out, indent=1))
    else:
        run_cases(args.cases, args.out, lambda flags: run_layout(parse_args(flags)))
    leave_after_barrier(dist)


def run_layout(args) -> dict:
    """One layout: a fresh mesh (a new DeviceMesh over the same process group), fresh
    models from seed 0, three steps on both; what this rank measured."""
    dims = ParallelDims(cp=args.cp, tp=args.tp, ep=args.ep)
    layout = Layout(dims, sequence_parallel=args.sp,
                    context_parallel=ContextParallel(args.algorithm, args.load_balance))
    mesh_context = MeshContext(build_device_mesh(dims, "cpu"), layout)
    rank = dist.get_rank()
    config = tiny_config(args.family, args.attn, args.kv_heads)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn,
                                                              dtype=torch.float32)
    if args.fused:
        fused(reference)
    parallel = copy.deepcopy(reference)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn,
                                                             dtype=torch.float32)
    if args.fused:
        fused(meta)
    result = ShardingPlanner(meta, layout).plan()
    document = json.loads(json.dumps(plan_to_json(
        layout=layout, applied_axes=result.applied_axes, recorded_axes=result.recorded_axes,
        modules=result.modules, roles=result.roles)))
    hyper_parallelize(parallel, mesh_context, document)

    batch = torch.randint(0, VOCAB, (2, args.seq_len), generator=torch.Generator().manual_seed(7))
    trained = train_steps(reference, parallel, batch, args.steps)
    contexts = {id(c): c for m in parallel.modules() if (c := getattr(m, CONTEXT_ATTRIBUTE, None)) is not None}
    with torch.no_grad():
        logits_shape = list(parallel(input_ids=batch).logits.shape)
    out = {
        "rank": rank,
        "context_parallel": ({"algorithm": document["layout"]["cp_algorithm"],
                              "load_balance": document["layout"]["cp_load_balance"]}
                             if "cp_algorithm" in document["layout"] else None),
        "roles": sorted(set(result.roles.values())),
        "losses": trained["losses"],
        "grad_failures": trained["grad_failures"],
        "grads_checked": trained["grads_checked"],
        "param_count": sum(1 for _ in parallel.parameters()),
        "attention_blocks": len(contexts),
        "query_lengths": sorted({n for c in contexts.values() for n in c.query_lengths}),
        "attention_calls": sum(c.calls for c in contexts.values()),
        "mask_free_calls": sum(c.mask_free_calls for c in contexts.values()),
        "inner_shapes": sorted({s for c in contexts.values() for s in c.inner_shapes}),
        "attn_implementation": parallel.config._attn_implementation,
        "reference_attn_implementation": reference.config._attn_implementation,
        "local_logits_shape": logits_shape,
    }
    return out


if __name__ == "__main__":
    main()
