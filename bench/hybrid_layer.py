"""A hybrid decoder's recurrent layer under tensor parallel: what splitting it by heads saves.

    python bench/hybrid_layer.py --json /tmp/hybrid.json          # Qwen3-Next, seq 2048, tp 2
    python bench/hybrid_layer.py --family qwen3_5_text --seq-len 512 --repeats 2

On CPU (gloo, two ranks under torchrun), one gated delta-net layer (``linear_attn``) of a
small Qwen3-Next or Qwen3.5 decoder (hidden 256; 4 key heads and 8 value heads of 32
dims: key_dim 128, value_dim 256, so ``[q | k | v]`` packs unequal blocks), called as its
decoder layer calls it, forward then backward of its output's sum, per rank, for:

- ``tp1``: the plain model on one rank;
- ``head_split``: tp2 as ``doit generate`` plans it (the dataflow of a traced copy): each
  rank runs the convolution and the gated delta rule on its heads, ``out_proj`` rowwise;
- ``gathered``: tp2 as the model's own TP plan says (transformers' and the peer's
  ``colwise_gather_output``): weights split, every rank runs the whole recurrence.

Per mode and rank: the median fwd+bwd seconds of ``--repeats`` runs (modes take turns,
after a warm-up round) and the bytes the forward saved for backward (autograd's saved
tensors, unique storages, the weights left out: the layer's activation memory). The JSON
has ``memory_ratio`` and ``time_ratio`` (head_split over tp1, the largest / slowest rank;
the issue's goal for memory: <= 0.6) and the same for ``gathered``; ``weight_ratio``: the
layer's parameter bytes a rank stores, head_split over tp1 (the packed convolution and
projections stored sharded in packed order: 0.5).
"""

import argparse
import copy
import json
from pathlib import Path

from activation_bytes import rank_mesh, run_ranks, step_runner, take_turns

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 256, 4, 8, 32
TRACE_TOKENS = 8
GOAL = 0.6


def hybrid_config(transformers, family: str):
    """A small decoder of the family: one linear-attention layer, one full-attention layer."""
    config = transformers.AutoConfig.for_model(
        family, vocab_size=256, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=1 << 16)
    if hasattr(config, "num_experts"):  # Qwen3-Next's MoE: a dense MLP keeps the bench on the layer
        config.num_experts, config.mlp_only_layers = 0, [0, 1]
    config._attn_implementation = "eager"
    return config


def parallel_hybrid(model, config, mesh_context, dims, *, traced: bool = True):
    """``model`` parallelized for ``dims`` as a generated file would: planned with the
    dataflow of a traced copy (as ``doit generate``), or by names and the TP plan alone.
    Returns it and the role of its first layer's linear attention."""
    import torch
    import transformers

    from hyper_parallel.config.layout import Layout
    from hyper_parallel.planning.dataflow import analyze
    from hyper_parallel.planning.local_widths_dry_run import local_widths_dry_run
    from hyper_parallel.distributed.mesh import MeshContext
    from hyper_parallel.distributed.plan_format import plan_to_json
    from hyper_parallel.planning.planner import ShardingPlanner
    from hyper_parallel.runtime import hyper_parallelize

    flow = None
    if traced:
        copy_ = copy.deepcopy(model)
        ids = torch.randint(0, config.vocab_size, (1, TRACE_TOKENS), generator=torch.Generator().manual_seed(0))
        flow = analyze(copy_, ids, tp=dims.tp, dry_run=local_widths_dry_run(copy_, ids, dims.tp),
                       sequence_split="cp" if dims.cp > 1 else None)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    layout = Layout(dims)
    result = ShardingPlanner(meta, layout, dataflow=flow).plan()
    role = result.roles.get("model.layers.0.linear_attn")
    document = plan_to_json(layout=layout, applied_axes=result.applied_axes, recorded_axes=result.recorded_axes,
                            modules=result.modules, roles=result.roles)
    return hyper_parallelize(model, MeshContext(mesh_context.device_mesh, layout), json.loads(json.dumps(document))), role


def linear_attention_runner(model, seq_len: int, local: int | None = None, rank: int = 0):
    """One fwd+bwd of the first layer's linear attention on the rank's ``local`` tokens (all
    by default): a function returning its seconds and the bytes its forward saved for
    backward (``activation_bytes``)."""
    import torch

    layer = model.model.layers[0].linear_attn
    hidden = torch.randn(1, seq_len, HIDDEN, generator=torch.Generator().manual_seed(0))
    if local is not None and local < seq_len:
        hidden = hidden[:, rank * local:(rank + 1) * local]
    return step_runner(model, lambda: layer(hidden_states=hidden.clone().requires_grad_(True)))


def layer_weight_bytes(model) -> int:
    """The bytes the rank stores for the first layer's linear attention's parameters (its
    local shards: a packed convolution stored sharded counts half at tp2, replicated whole)."""
    layer = model.model.layers[0].linear_attn
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in layer.parameters())


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from hyper_parallel.distributed.mesh import ParallelDims

    dims = ParallelDims(tp=2)
    mesh_context, rank = rank_mesh(dims)
    config = hybrid_config(transformers, args.family)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    models = {"tp1": copy.deepcopy(base)}
    roles = {}
    for name, traced in (("head_split", True), ("gathered", False)):
        models[name], roles[name] = parallel_hybrid(copy.deepcopy(base), config, mesh_context, dims, traced=traced)
    runners = {name: linear_attention_runner(model, args.seq_len) for name, model in models.items()}
    results = take_turns(runners, args.repeats)
    for name, result in results.items():
        result["linear_attn_role"] = roles.get(name, "(one process)")
        result["weight_bytes"] = layer_weight_bytes(models[name])
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def summarize(ranks: list[dict], args) -> dict:
    """The JSON the bench writes: per mode and rank, and the ratios (see the docstring)."""
    modes = list(ranks[0])
    worst = {mode: {key: max(r[mode][key] for r in ranks) for key in ("seconds", "saved_bytes", "weight_bytes")}
             for mode in modes}
    whole = worst["tp1"]
    summary = {
        "family": args.family, "seq_len": args.seq_len, "tp": 2,
        "layer": f"gated delta-net: hidden {HIDDEN}, {KEY_HEADS} key / {VALUE_HEADS} value heads of {HEAD_DIM}",
        "roles": {mode: ranks[0][mode]["linear_attn_role"] for mode in modes},
        "per_rank": {mode: [r[mode] for r in ranks] for mode in modes},
        "memory_ratio": worst["head_split"]["saved_bytes"] / whole["saved_bytes"],
        "time_ratio": worst["head_split"]["seconds"] / whole["seconds"],
        "weight_ratio": worst["head_split"]["weight_bytes"] / whole["weight_bytes"],
        "gathered_memory_ratio": worst["gathered"]["saved_bytes"] / whole["saved_bytes"],
        "gathered_time_ratio": worst["gathered"]["seconds"] / whole["seconds"],
        "memory_goal": GOAL,
    }
    summary["memory_goal_met"] = summary["memory_ratio"] <= GOAL
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("qwen3_next", "qwen3_5_text"), default="qwen3_next")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    ranks = run_ranks(__file__, ["--family", args.family, "--seq-len", str(args.seq_len),
                                 "--repeats", str(args.repeats)])
    summary = summarize(ranks, args)
    text = json.dumps(summary, indent=1)
    print(text)
    print(f"head_split activation bytes tp2/tp1: {summary['memory_ratio']:.3f} (goal <= {GOAL}: "
          f"{'PASS' if summary['memory_goal_met'] else 'FAIL'}); gathered: {summary['gathered_memory_ratio']:.3f}; "
          f"time head_split {summary['time_ratio']:.3f}, gathered {summary['gathered_time_ratio']:.3f}; "
          f"layer weight bytes per rank head_split/tp1 {summary['weight_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
