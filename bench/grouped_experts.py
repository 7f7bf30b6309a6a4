"""GroupedExperts vs transformers' Qwen3MoeExperts (its eager per-expert loop), on CPU.

    python -m bench.grouped_experts [--experts 32 --tokens 1024 --top-k 8 --hidden 256
                                     --intermediate 128 --repeats 9 --hf-implementation eager
                                     --json out.json]

Both modules hold the same weights and see the same tokens and routing. Each repeat
times the two implementations back to back (alternating which goes first), so load
from other processes hits both alike; medians are reported with their ratio.
Goal: at least 2x faster than the eager loop, forward and forward+backward.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hyper_parallel.components.modules.grouped_experts import replace_qwen3_moe_grouped_experts

GOAL_SPEEDUP = 2.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-implementation", default="eager", choices=("eager", "batched_mm", "grouped_mm"),
                        help="transformers' experts implementation to compare with (default: its eager loop)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args()


def build_modules(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Qwen3MoeConfig(num_experts=args.experts, hidden_size=args.hidden,
                            moe_intermediate_size=args.intermediate, num_experts_per_tok=args.top_k)
    config._experts_implementation = args.hf_implementation  # "eager": HF's per-expert loop
    hf = Qwen3MoeExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj, std=config.initializer_range)
    torch.nn.init.normal_(hf.down_proj, std=config.initializer_range)
    return hf, replace_qwen3_moe_grouped_experts(hf)


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens and a softmax top-k routing, as Qwen3MoeTopKRouter produces it."""
    hidden = torch.randn(args.tokens, args.hidden)
    probs = torch.softmax(torch.randn(args.tokens, args.experts), dim=-1)
    weights, index = torch.topk(probs, args.top_k, dim=-1)
    return hidden, index, weights / weights.sum(dim=-1, keepdim=True)


def time_once(module: torch.nn.Module, inputs, backward: bool) -> float:
    hidden, index, weights = inputs
    hidden = hidden.detach().requires_grad_(backward)
    module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = module(hidden, index, weights)
    if backward:
        out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def measure(hf, grouped, inputs, args: argparse.Namespace, backward: bool) -> dict:
    times = {"hf": [], "grouped": []}
    for repeat in range(args.warmup + args.repeats):
        order = (("hf", hf), ("grouped", grouped)) if repeat % 2 else (("grouped", grouped), ("hf", hf))
        for name, module in order:
            seconds = time_once(module, inputs, backward)
            if repeat >= args.warmup:
                times[name].append(seconds)
    hf_s, grouped_s = statistics.median(times["hf"]), statistics.median(times["grouped"])
    return {"hf_median_s": hf_s, "grouped_median_s": grouped_s, "speedup": hf_s / grouped_s}


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    hf, grouped = build_modules(args)
    inputs = make_inputs(args)
    with torch.no_grad():
        max_diff = (hf(*inputs) - grouped(*inputs)).abs().max().item()
    results = {
        "hf_implementation": args.hf_implementation,
        "shape": {"experts": args.experts, "tokens": args.tokens, "top_k": args.top_k,
                  "hidden": args.hidden, "intermediate": args.intermediate},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "max_abs_diff_forward": max_diff,
        "forward": measure(hf, grouped, inputs, args, backward=False),
        "forward_backward": measure(hf, grouped, inputs, args, backward=True),
        "goal_speedup": GOAL_SPEEDUP,
    }
    shape = results["shape"]
    print(f"experts={shape['experts']} tokens={shape['tokens']} top_k={shape['top_k']} "
          f"hidden={shape['hidden']} intermediate={shape['intermediate']} "
          f"(torch {results['torch']}, {results['threads']} threads, median of {args.repeats}; "
          f"HF experts implementation: {args.hf_implementation})")
    print(f"max |hf - grouped| forward: {max_diff:.3e}")
    for phase in ("forward", "forward_backward"):
        r = results[phase]
        verdict = "meets" if r["speedup"] >= GOAL_SPEEDUP else "BELOW"
        goal = f" ({verdict} the {GOAL_SPEEDUP:g}x goal)" if args.hf_implementation == "eager" else ""
        print(f"{phase:17s} hf {r['hf_median_s'] * 1e3:9.2f} ms   grouped {r['grouped_median_s'] * 1e3:9.2f} ms   "
              f"speedup {r['speedup']:6.2f}x{goal}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
