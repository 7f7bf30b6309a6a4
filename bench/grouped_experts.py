"""GroupedExperts vs transformers' Qwen3MoeExperts (its eager per-expert loop), on CPU.

    python bench/grouped_experts.py [--shapes tiny,small,qwen3-30b-a3b] [--experts 32]
                                    [--tokens 1024] [--top-k 8] [--repeats N] [--json out.json]
                                    [--hf-implementation eager|batched_mm|grouped_mm] [--system-malloc]

Per layer shape (hidden / intermediate size; 32 experts, 1024 tokens, top-8 by default):

* tiny: 64 / 32, the tiny recipe's layer
* small: 256 / 128
* qwen3-30b-a3b: 2048 / 768, Qwen3-30B-A3B's layer (32 of its 128 experts)

Both modules hold the same weights and see the same tokens and routing. Each repeat times
the implementations back to back (alternating the order), so load from other processes
hits them alike; medians are reported with their ratio. Times cover the forward alone
and a training step (forward + backward, the routing weights and the tokens requiring
grad as in a model).

The matmul floor is the same routing's expert matmuls alone, on rows already gathered
by expert, measured in the same run: no implementation of these experts can run faster
than it, so "ceiling" (HF time / floor) bounds any speedup on this machine. Where the
layer is matmul-bound the forward's ceiling is below 2x; the loop's cost is mostly in
its backward (a full-size weight gradient per expert), which is where a grouped
implementation gains.

The floor does the matmul FLOPs of a real step, no fewer: forward 2 matmuls per expert
(gate/up, down), backward 4 (grad act, grad down, grad gate/up, grad input). It leaves
out everything that is not a matmul: the gathers and scatters, the activation, the
routing-weight gradient, and first touching the fresh weight-gradient tensors a step
with ``zero_grad(set_to_none=True)`` must fill (its per-expert products land in
recycled memory). ``grad_first_touch`` reports that last cost alone (allocating and
filling both expert weight gradients), for reference; it is not added to the floor.

The bench runs with freed memory kept in the heap (``host_malloc.KEEP_FREED_MEMORY``, as
jemalloc / tcmalloc keep it in training): with glibc's defaults each step's hundreds of
MiB of gradients and kept rows are unmapped when freed and faulted in again, page by
page, on the next step, and that swings from run to run (the same grouped step 1.4 s or
2.2 s at the Qwen3-30B-A3B shape here). ``--system-malloc`` measures with glibc's
defaults (then ``grad_first_touch`` is the page faults' cost; kept in the heap, it is
only the fill).

Goals: the training step at least 2x faster than the eager loop; the grouped training
step within FLOOR_GOAL times the matmul floor (``floor_ratio``).
"""

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from host_malloc import KEEP_FREED_MEMORY, restart_keeping_freed_memory
from hyper_parallel.components.modules.routed_experts import ExpertRoutes
from hyper_parallel.models.qwen3_moe.adapter.replacements import replace_qwen3_moe_grouped_experts

GOAL_SPEEDUP = 2.0
FLOOR_GOAL = {"qwen3-30b-a3b": 1.2, "small": 1.5}
SHAPES = {"tiny": (64, 32), "small": (256, 128), "qwen3-30b-a3b": (2048, 768)}
# A training step of the model-sized layer takes seconds with the eager loop.
DEFAULT_REPEATS = {"tiny": 31, "small": 31, "qwen3-30b-a3b": 5}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, from {sorted(SHAPES)} (default: all)")
    parser.add_argument("--hidden", type=int, help="a custom shape's hidden size (with --intermediate)")
    parser.add_argument("--intermediate", type=int, help="a custom shape's expert intermediate size")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, help="timed repeats per shape (default: 31, 5 for qwen3-30b-a3b)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-implementation", default="eager", choices=("eager", "batched_mm", "grouped_mm"),
                        help="transformers' experts implementation to compare with (default: its eager loop)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--system-malloc", action="store_true",
                        help="glibc's default thresholds: each step's large buffers go back to the OS when freed "
                             "and are faulted in again on the next (see bench/host_malloc.py)")
    args = parser.parse_args()
    if (args.hidden is None) != (args.intermediate is None):
        parser.error("--hidden and --intermediate go together")
    names = [name for name in args.shapes.split(",") if name]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    args.shape_list = [(name, *SHAPES[name]) for name in names]
    if args.hidden is not None:
        args.shape_list = [("custom", args.hidden, args.intermediate)]
    return args


def build_modules(args: argparse.Namespace, hidden: int, intermediate: int):
    config = Qwen3MoeConfig(num_experts=args.experts, hidden_size=hidden,
                            moe_intermediate_size=intermediate, num_experts_per_tok=args.top_k)
    config._experts_implementation = args.hf_implementation  # "eager": HF's per-expert loop
    hf = Qwen3MoeExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj, std=config.initializer_range)
    torch.nn.init.normal_(hf.down_proj, std=config.initializer_range)
    return hf, replace_qwen3_moe_grouped_experts(hf)


def make_inputs(args: argparse.Namespace, hidden_size: int):
    """Tokens and a softmax top-k routing, as Qwen3MoeTopKRouter produces it."""
    hidden = torch.randn(args.tokens, hidden_size)
    probs = torch.softmax(torch.randn(args.tokens, args.experts), dim=-1)
    weights, index = torch.topk(probs, args.top_k, dim=-1)
    return hidden, index, weights / weights.sum(dim=-1, keepdim=True)


def module_step(module, inputs, backward: bool):
    def step() -> None:
        hidden, index, weights = (tensor.detach() for tensor in inputs)
        hidden.requires_grad_(backward)
        weights.requires_grad_(backward)
        module.zero_grad(set_to_none=True)
        out = module(hidden, index, weights)
        if backward:
            out.backward(torch.ones_like(out))
    return step


def matmul_floor_step(module, inputs, backward: bool):
    """The expert matmuls of this routing alone: 2 per expert forward, 4 more backward."""
    hidden, index, _ = inputs
    routes = ExpertRoutes.of(index, module.gate_up_proj.shape[0])
    rows = hidden[routes.token].split(routes.counts_list)
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()

    def step() -> None:
        for expert, x in enumerate(rows):
            if x.shape[0] == 0:
                continue
            gate_up_out = x @ gate_up[expert].t()
            act = gate_up_out[:, :down.shape[2]]
            out = act @ down[expert].t()
            if backward:
                # Shapes of: grad act, grad down, grad gate_up, grad input.
                for left, right in ((out, down[expert]), (out.t(), act), (gate_up_out.t(), x),
                                    (gate_up_out, gate_up[expert])):
                    torch.mm(left, right)
    return step


def grad_first_touch_step(module):
    """What materializing the expert weight gradients costs a step (new tensors, each
    page written once): outside the floor, since it is no matmul, but no step avoids it."""
    def step() -> None:
        torch.empty_like(module.gate_up_proj).fill_(0.0)
        torch.empty_like(module.down_proj).fill_(0.0)
    return step


def median_times(steps: dict, args: argparse.Namespace, repeats: int) -> dict:
    times = {name: [] for name in steps}
    names = list(steps)
    for repeat in range(args.warmup + repeats):
        for name in (names if repeat % 2 else names[::-1]):
            start = time.perf_counter()
            steps[name]()
            if repeat >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_shape(args: argparse.Namespace, name: str, hidden_size: int, intermediate: int) -> dict:
    torch.manual_seed(args.seed)
    hf, grouped = build_modules(args, hidden_size, intermediate)
    inputs = make_inputs(args, hidden_size)
    with torch.no_grad():
        max_diff = (hf(*inputs) - grouped(*inputs)).abs().max().item()
    repeats = args.repeats or DEFAULT_REPEATS.get(name, 31)
    result = {"shape": {"hidden": hidden_size, "intermediate": intermediate}, "repeats": repeats,
              "max_abs_diff_forward": max_diff}
    for phase, backward in (("forward", False), ("training_step", True)):
        medians = median_times({"hf": module_step(hf, inputs, backward),
                                "grouped": module_step(grouped, inputs, backward),
                                "matmul_floor": matmul_floor_step(grouped, inputs, backward)}, args, repeats)
        result[phase] = {**{f"{key}_median_s": value for key, value in medians.items()},
                         "speedup": medians["hf"] / medians["grouped"],
                         "ceiling": medians["hf"] / medians["matmul_floor"],
                         "floor_ratio": medians["grouped"] / medians["matmul_floor"]}
    result["grad_first_touch_median_s"] = median_times({"touch": grad_first_touch_step(grouped)}, args, repeats)["touch"]
    goal = FLOOR_GOAL.get(name)
    result["floor_goal"] = goal
    if goal is not None:
        result["floor_goal_pass"] = result["training_step"]["floor_ratio"] <= goal
    return result


def print_shape(args: argparse.Namespace, name: str, result: dict) -> None:
    shape = result["shape"]
    print(f"\n{name}: hidden {shape['hidden']}, intermediate {shape['intermediate']} "
          f"(median of {result['repeats']}; max |hf - grouped| forward {result['max_abs_diff_forward']:.1e})")
    for phase in ("forward", "training_step"):
        r = result[phase]
        verdict = ""
        if phase == "training_step" and args.hf_implementation == "eager":
            verdict = f"  {'meets' if r['speedup'] >= GOAL_SPEEDUP else 'BELOW'} the {GOAL_SPEEDUP:g}x goal"
        print(f"  {phase:13s} hf {r['hf_median_s'] * 1e3:9.2f} ms   grouped {r['grouped_median_s'] * 1e3:9.2f} ms   "
              f"speedup {r['speedup']:5.2f}x   matmul floor {r['matmul_floor_median_s'] * 1e3:9.2f} ms "
              f"(ceiling {r['ceiling']:5.2f}x, grouped/floor {r['floor_ratio']:4.2f}x){verdict}")
    print(f"  weight-gradient first touch (not in the floor) {result['grad_first_touch_median_s'] * 1e3:.2f} ms")
    if result["floor_goal"] is not None:
        print(f"  floor goal: training step <= {result['floor_goal']:g}x the matmul floor: "
              f"{'PASS' if result['floor_goal_pass'] else 'FAIL'} "
              f"({result['training_step']['floor_ratio']:.2f}x)")


def main() -> None:
    args = parse_args()
    if not args.system_malloc:
        restart_keeping_freed_memory()
    malloc = "system" if args.system_malloc else f"freed memory kept in the heap ({KEEP_FREED_MEMORY})"
    print(f"experts={args.experts} tokens={args.tokens} top_k={args.top_k} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; HF experts implementation: {args.hf_implementation}; malloc: {malloc})")
    results = {"experts": args.experts, "tokens": args.tokens, "top_k": args.top_k, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "hf_implementation": args.hf_implementation, "malloc": malloc,
               "goal_speedup": GOAL_SPEEDUP, "floor_goal": FLOOR_GOAL, "shapes": {}}
    for name, hidden_size, intermediate in args.shape_list:
        results["shapes"][name] = bench_shape(args, name, hidden_size, intermediate)
        print_shape(args, name, results["shapes"][name])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
