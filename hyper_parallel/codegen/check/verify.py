"""verify: run a bundle's generated model at the recipe's world size and
layout, on a shrunk probe of the recipe's model, and compare with one process.

The probe (``probe.py``) keeps every property the frozen plan depends on. The reference
is the source model class (HF's, or the model folder's remote code) unsharded, with the
same weights and tokens: a lowered ``replace_module`` is checked against what it
replaces. Two training steps (forward + backward, AdamW step, forward + backward); the
loss (rtol 1e-5), the global gradient norm and every parameter's gathered gradient must
agree at both — a gradient counted twice on a replicated weight fails even when the
losses agree. At step 1 (both sides on the same weights) every element is compared (rtol
1e-4 / atol 1e-6); at step 2 each gradient is compared at its own scale (largest
difference within 1e-6 + 1e-4 x its largest element): AdamW moves every weight by about
``lr * sign(g)``, so roundoff in a gradient element near zero at step 1 (other reduction
orders over the ranks) becomes a weight difference of order ``lr`` there, which an
element-wise check at step 2 would call a plan error. A wrong reduction is off by the
gradient's own size at both steps.

Ranks run as torchrun processes up to ``max_processes()`` (default 2 x CPUs,
``$HYPER_PARALLEL_VERIFY_MAX_PROCS``), above it as threads of one process over torch's
threaded process group (``verify_worker``): never more processes than the cap.
"""

import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyper_parallel.codegen.check.rank_preload import rank_preload
from hyper_parallel.codegen.check.verify_mode import STEPS, VerifyError, verify_mode
from hyper_parallel.codegen.check.verify_ranks import brief_entry
from hyper_parallel.codegen.check.verify_worker import LR, seed_step
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.launch.forked_torchrun import torchrun_command
from hyper_parallel.launch.ranks import (
    LaunchError,
    RankFiles,
    RankLaunch,
    kill_tree,
    last_error_line,
    scratch_dir,
    wait_for_ranks,
)
from hyper_parallel.protocols.axes import CP, TP

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
# Plus this fraction of the tensor's largest element: float32 sums taken in another order
# (a reduce-scatter, a gathered matmul) differ by ~1e-6 of the largest term, which for a
# gradient of large elements (Gemma 3n's scaled, tied embedding) exceeds GRAD_ATOL alone.
GRAD_SCALE_ATOL = 1e-5
OUTPUT_RTOL, OUTPUT_ATOL = 1e-4, 1e-5
LAUNCH_TIMEOUT_S = 900

_LOG = logging.getLogger(__name__)


@dataclass
class Probe:
    config: Any
    depth: int
    full_depth: int
    seq_len: int
    weights: dict[str, Any]
    tokens: Any
    tied: dict[str, tuple[str, ...]]  # parameter name -> every name of the same tensor
    pipeline: dict[str, Any] | None = None  # under pp: the probe's stage split and micro-batches per dp rank


def verify_bundle(spec: CodegenSpec, bundle_dir: Path, bundle_key: str, files: dict[str, str],
                  model_class: str) -> dict[str, Any]:
    """Verify the bundle in ``bundle_dir`` (staged or installed); return the figures. The
    caller's random state is left as it was (training may seed, generate, then build)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return _verify_bundle(spec, bundle_dir, bundle_key, files, model_class)


def _verify_bundle(spec: CodegenSpec, bundle_dir: Path, bundle_key: str, files: dict[str, str],
                   model_class: str) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    world = spec.layout.world_size
    mode = verify_mode(world)
    with scratch_dir("verify") as tmp:
        probe = build_probe(spec, Path(tmp) / "probe")
        _refuse_if_stochastic(spec, probe)
        job = _job(spec, bundle_dir, bundle_key, files, model_class, Path(tmp), diagnose=False,
                   pipeline=probe.pipeline)
        split = (f"; pipeline stages {' '.join(f'[{a}, {b})' for a, b in probe.pipeline['stages'])}, "
                 f"{probe.pipeline['microbatches']} micro-batches" if probe.pipeline else "")
        _LOG.info(f"[verify] probe: {probe.depth} of {probe.full_depth} layer(s), hidden {probe.config.hidden_size}, "
                  f"{probe.seq_len} tokens x {probe.tokens.shape[0]} sequence(s){split}; {world} ranks as {mode}")
        with _launch(job, mode, world) as proc:
            expected = reference_run(spec, probe)  # while the ranks start and run
            _finish(proc, job, mode, world, spec)
        got = torch.load(job["result"], weights_only=True)
        expected = continued_from(expected, reference_run(spec, probe, first_grads=got["grads"][0]))
        failure, figures = compare_runs(expected, got)
        if failure is not None:
            divergence = _first_divergence(spec, probe, job, Path(tmp), mode, world)
            raise VerifyError(_failure_message(spec, failure, divergence, bundle_dir, job, world, mode, probe))
    seconds = time.perf_counter() - start
    # No timing in the report: verify.json is install's file dependency, and a second
    # run (a concurrent generate) must write the same bytes or doit redoes install.
    report = {"mode": mode, "world": world, "steps": STEPS, **figures}
    _LOG.info(f"[verify] ok: world {world} ({mode}), {STEPS} steps, max loss rel err {figures['max_loss_rel']:.1e}, "
              f"max grad rel err {figures['max_grad_rel']:.1e}, {len(got['grads'][0])} parameters, {seconds:.1f}s")
    return report


# --- the probe and the reference -----------------------------------------------------------------

def build_probe(spec: CodegenSpec, probe_dir: Path) -> Probe:
    """Shrink the recipe's config, make seeded weights and tokens, save them for the ranks."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyper_parallel.codegen.check.probe import (
        ProbeError,
        faithful_probe_config,
        layer_kinds,
        probe_shape,
        shrink_widths,
    )
    from hyper_parallel.codegen.plan.derive import build_hf_config, trusts_remote_code

    p = spec.layout
    overrides = f" with {spec.recipe_path.name}'s model.config_overrides" if spec.config_overrides else ""
    where = f"{spec.model_dir / 'config.json'}{overrides} (verify probe)"
    stages = p.pipeline.stages(p.pp) if p.pp > 1 else 1
    shape = probe_shape(p.dp, p.cp, p.tp, stages)
    config = build_hf_config(spec)
    config._attn_implementation = spec.attn_implementation
    wide = shrink_widths(config, tp=p.tp, ep=p.ep, seq_len=shape.seq_len, where=where)
    remote = trusts_remote_code(spec)
    probe_config, depth, kinds = faithful_probe_config(wide, remote=remote, where=where,
                                                       min_depth=max(stages, 2 if p.cp > 1 or p.sequence_parallel
                                                                     else 1))
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(probe_config, trust_remote_code=remote, dtype=torch.float32)
    if layer_kinds(reference, probe_config) != kinds[:depth]:
        raise ProbeError(f"{where}: num_hidden_layers: the first {depth} layer(s) of a {depth}-layer model differ "
                         f"from the first {depth} of the {len(kinds)}-layer model (the config derives layer kinds "
                         f"from the depth); verify cannot shrink this model faithfully")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, probe_config.vocab_size, (shape.batch, shape.seq_len), generator=generator)
    state = reference.state_dict()
    weights = {name: tensor.detach().clone() for name, tensor in state.items()}
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    tied = {name: tuple(names) for names in by_storage.values() if len(names) > 1 for name in names}
    probe_dir.mkdir(parents=True)
    probe_config.save_pretrained(probe_dir)
    torch.save({"weights": weights, "tokens": tokens}, probe_dir / "probe.pt")
    return Probe(probe_config, depth, len(kinds), shape.seq_len, weights, tokens, tied,
                 probe_pipeline(spec, reference, shape.microbatches))


def probe_pipeline(spec: CodegenSpec, reference, microbatches: int) -> dict[str, Any] | None:
    """Under pp: the probe's decoder layers split into the recipe's number of stages,
    balanced (the recorded split is the full model's; its layer indices and the recipe's
    ``split_points`` point past the probe's few layers), and the micro-batches per dp rank."""
    from hyper_parallel.config.pipeline import PipelineSettings, stage_split
    from hyper_parallel.distributed.pipeline import decoder_layer_weights

    p = spec.layout
    if p.pp == 1:
        return None
    settings = PipelineSettings(p.pipeline.schedule, virtual_stages=p.pipeline.virtual_stages)
    stages = stage_split(settings, p.pp, decoder_layer_weights(reference))
    return {"stages": [list(stage) for stage in stages], "microbatches": microbatches}


def reference_model(spec: CodegenSpec, probe: Probe):
    import torch
    from transformers import AutoModelForCausalLM

    from hyper_parallel.codegen.plan.derive import trusts_remote_code

    model = AutoModelForCausalLM.from_config(probe.config, trust_remote_code=trusts_remote_code(spec),
                                             dtype=torch.float32)
    model.load_state_dict(probe.weights, strict=True)
    return model.train()


def continued_from(first: dict[str, list], continued: dict[str, list]) -> dict[str, list]:
    """Step 1 of the plain reference run, the later steps of the one that stepped with the
    parallel run's step-1 gradients."""
    return {key: first[key][:1] + continued[key][1:] for key in first}


def reference_run(spec: CodegenSpec, probe: Probe, first_grads: dict | None = None) -> dict[str, list]:
    """The probe unsharded in this process: what every rank together must reproduce. Each
    data-parallel rank's sequence is one micro-batch of the global-batch mean.

    ``first_grads``: step with these gradients at step 1 (the parallel run's, already
    compared): the later steps then check the parallel run's update and its next steps
    from the same point. AdamW divides each element by its own running magnitude, so the
    float noise of a right plan in a gradient element near zero (1e-7 of the largest) moves
    that weight by up to the whole learning rate, and the step-2 gradients of one process
    differ from themselves by ~1e-4 under such noise alone."""
    import torch

    model = reference_model(spec, probe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    record: dict[str, list] = {"losses": [], "norms": [], "grads": []}
    sequences = probe.tokens.shape[0]
    for step in range(STEPS):
        total = 0.0
        seed_step(step)
        for index in range(sequences):
            batch = probe.tokens[index:index + 1]
            loss = model(input_ids=batch, labels=batch).loss / sequences
            loss.backward()
            total += loss.item()
        grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
        if first_grads is not None and not record["losses"]:
            for name, param in model.named_parameters():
                given = first_grads.get(name)
                if param.grad is not None and given is not None and given.shape == param.grad.shape:
                    param.grad.copy_(given)  # (a wrong shape fails the step-1 comparison)
        record["norms"].append(torch.nn.utils.get_total_norm([g for g in grads.values() if g is not None]).item())
        record["losses"].append(total)
        record["grads"].append(grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def _refuse_if_stochastic(spec: CodegenSpec, probe: Probe) -> None:
    """Refuse a model whose training forward draws random numbers with every dropout
    probability at 0 (PhiMoE's router samples its experts, Gumbel-style) under a layout
    where a rank cannot draw what one process draws. Verify and training seed every step
    alike on every rank and in the reference (``seed_step``), so where every rank runs all
    the tokens through the same code (tensor parallel alone, ranks as processes) the draws
    are the same, as transformers' own tp2 has them; splitting the tokens (sequence or
    context parallel) or the batch (data or expert parallel) changes what each rank draws,
    and a lucky draw could pass verify with a wrong plan. Checked on the reference model:
    one training-mode forward that moves the random state. (Dropout at probability 0
    draws nothing.)"""
    import torch

    from hyper_parallel.codegen.check.probe import ProbeError

    p = spec.layout
    splits = [key for key, on in (("sequence_parallel", p.sequence_parallel and p.tp > 1), ("cp_size", p.cp > 1),
                                  ("dp_size", p.dp > 1), ("ep_size", p.ep > 1)) if on]
    threads = verify_mode(p.world_size) == "threads"
    if not splits and not threads:
        return
    model = reference_model(spec, probe)
    state = torch.random.get_rng_state()
    with torch.no_grad():
        model(input_ids=probe.tokens[:1])
    drew = not torch.equal(state, torch.random.get_rng_state())
    torch.random.set_rng_state(state)
    if drew:
        why = (f"accelerator.{', accelerator.'.join(splits)} split the tokens or the batch, so each rank draws other "
               "numbers than one process does") if splits else (
               f"world {p.world_size} is verified as threads of one process, which share one random state")
        raise ProbeError(f"{spec.model_dir / 'config.json'}: {type(model).__name__}'s training forward draws random "
                         f"numbers (sampling, noise; every dropout probability is 0), and {why}: its training is "
                         "stochastic, a rank equals one process only where it draws the same numbers for the same "
                         "tokens (tensor parallel alone), so verify cannot prove a plan on it; use tp_size alone "
                         "for this model")


# --- comparing ---------------------------------------------------------------------------------

def compare_runs(expected: dict[str, list], got: dict[str, list]) -> tuple[dict | None, dict[str, float]]:
    """The first failure (loss, a parameter's gradient, the global norm), worst parameter
    first within a step; and the largest relative errors seen."""
    import torch

    max_loss_rel = max_grad_rel = 0.0
    for step in range(STEPS):
        want, have = expected["losses"][step], got["losses"][step]
        loss_rel = abs(have - want) / max(abs(want), 1e-12)
        max_loss_rel = max(max_loss_rel, loss_rel)
        missing = sorted(set(expected["grads"][step]) ^ set(got["grads"][step]))
        if missing:
            return {"step": step + 1, "kind": "names", "names": missing}, {}
        worst = None
        for name, ref in expected["grads"][step].items():
            grad = got["grads"][step][name]
            if ref is None and grad is None:
                continue
            if ref is None or grad is None or grad.shape != ref.shape:
                worst = {"step": step + 1, "kind": "grad", "name": name, "rel": float("inf"),
                         "want_norm": _norm(ref), "got_norm": _norm(grad)}
                break
            rel = ((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            max_grad_rel = max(max_grad_rel, rel)
            spread = got["spreads"][step].get(name, 0.0)
            if spread > GRAD_ATOL + GRAD_RTOL * ref.abs().max().item():
                return {"step": step + 1, "kind": "replicas", "name": name, "spread": spread,
                        "largest": ref.abs().max().item()}, {}
            scale_atol = GRAD_ATOL + GRAD_SCALE_ATOL * ref.abs().max().item()
            agrees = (torch.allclose(grad, ref, rtol=GRAD_RTOL, atol=scale_atol) if step == 0 else
                      (grad - ref).abs().max().item() <= GRAD_ATOL + GRAD_RTOL * ref.abs().max().item())
            if not agrees and (worst is None or rel > worst["rel"]):
                worst = {"step": step + 1, "kind": "grad", "name": name, "rel": rel,
                         "want_norm": _norm(ref), "got_norm": _norm(grad)}
        if worst is not None:
            return worst, {}
        if loss_rel > LOSS_RTOL:
            return {"step": step + 1, "kind": "loss", "want": want, "got": have, "rel": loss_rel}, {}
        want_norm, got_norm = expected["norms"][step], got["norms"][step]
        if abs(got_norm - want_norm) > GRAD_RTOL * abs(want_norm):
            return {"step": step + 1, "kind": "norm", "want": want_norm, "got": got_norm}, {}
    return None, {"max_loss_rel": _two_digits(max_loss_rel), "max_grad_rel": _two_digits(max_grad_rel)}


def _norm(tensor) -> float | None:
    return None if tensor is None else tensor.norm().item()


def _two_digits(value: float) -> float:
    """Two significant digits: the figure is recorded in the bundle's meta."""
    return float(f"{value:.1e}")


def _tied_note(name: str, probe: Probe) -> str:
    """Tied parameters share one gradient from two places (embedding and output head)."""
    others = [other for other in probe.tied.get(name, ()) if other != name]
    return f" (tied with {', '.join(others)})" if others else ""


def _failure_message(spec: CodegenSpec, failure: dict, divergence: str, bundle_dir: Path, job: dict,
                     world: int, mode: str, probe: Probe) -> str:
    head = f"verify failed for {bundle_dir} (world {world}, {mode}) at step {failure['step']}: "
    if failure["kind"] == "names":
        body = f"parameters differ between the generated model and the reference: {failure['names'][:5]}"
    elif failure["kind"] == "loss":
        body = (f"loss {failure['got']:.8g}, one device gives {failure['want']:.8g} "
                f"(rel err {failure['rel']:.1e} > {LOSS_RTOL})")
    elif failure["kind"] == "replicas":
        key, entry = _plan_entry(job, failure["name"])
        body = (f"the ranks hold different gradients for {failure['name']}{_tied_note(failure['name'], probe)} "
                f"(copies differ by up to {failure['spread']:.3g}; its largest element is {failure['largest']:.3g}), "
                f"so they would train different weights; plan entry {key!r}: {entry}")
    elif failure["kind"] == "norm":
        body = f"global gradient norm {failure['got']:.6g}, one device gives {failure['want']:.6g}"
    else:
        key, entry = _plan_entry(job, failure["name"])
        body = (f"gradient of {failure['name']}{_tied_note(failure['name'], probe)} differs from one device's (max rel err {failure['rel']:.2g}; "
                f"rtol {GRAD_RTOL}, atol {GRAD_ATOL} + {GRAD_SCALE_ATOL} x the largest element): norm {_fmt(failure['got_norm'])}, expected "
                f"{_fmt(failure['want_norm'])}; plan entry {key!r}: {entry}")
    stages = ("\n  under pipeline parallel: where the layout without pp verifies, this family's stages do not "
              "compute the whole model (a later stage, fed hidden states, computes something from them that the "
              "whole model computes from the embeddings; or a module outside the decoder layers runs on several "
              "stages); set accelerator.pp_size: 1" if spec.layout.pp > 1 else "")
    return (head + body + f"\n  first module whose forward output diverges: {divergence}{stages}"
            f"\n  the previous bundle is left as it was; fix the plan_overrides (or the planner) and run "
            f"`doit generate config={spec.recipe_path}`")


def _fmt(value) -> str:
    return "none" if value is None else f"{value:.6g}"


def _plan_entry(job: dict, param_name: str) -> tuple[str | None, Any]:
    """The entry that places ``param_name`` (``name_match.placement_of``, as the applier reads
    the plan), else the entry of the module that holds it, else none."""
    from hyper_parallel.distributed.name_match import placement_of, plan_entry_for
    from hyper_parallel.distributed.plan_format import plan_entries
    from hyper_parallel.runtime.loader import load_bundle_module

    module = load_bundle_module(job["bundle_dir"], job["modeling_file"], job["bundle_key"], job["files"])
    entries = plan_entries(module.HYPER_PARALLEL_PLAN)
    placed = placement_of(param_name, entries)
    found = (placed.key, placed.entry) if placed else plan_entry_for(param_name.rpartition(".")[0], entries)
    if found is None:
        return None, "no entry (replicated everywhere)"
    return found[0], brief_entry(found[1])


# --- the first diverging module ------------------------------------------------------------------

def _first_divergence(spec, probe, run_job: dict, tmp: Path, mode: str, world: int) -> str:
    """Rerun one forward with every module's output recorded on every rank; walk the
    reference's modules in the order their outputs were made."""
    import torch

    job = _job(spec, Path(run_job["bundle_dir"]), run_job["bundle_key"], run_job["files"], run_job["model_class"],
               tmp, diagnose=True, pipeline=run_job["pipeline"])
    try:
        with _launch(job, mode, world) as proc:
            expected = _reference_outputs(spec, probe)
            _finish(proc, job, mode, world, spec)
        ranks = torch.load(job["result"], weights_only=False)["outputs"]
    except VerifyError as exc:
        return f"(diagnosis failed: {exc})"
    from hyper_parallel.config.layout import Layout
    from hyper_parallel.planning.offline_mesh import build_offline_mesh

    mesh = build_offline_mesh(Layout.from_dict(job["layout"], where="verify job").dims)
    coords = [dict(zip(mesh.axis_names, mesh.coordinates(rank))) for rank in range(world)]
    views = _pipeline_views(ranks, coords)
    for name, want in expected.items():
        for label, view in views:
            have = _reassemble(name, want, view, coords)
            if have is None or torch.allclose(have, want, rtol=OUTPUT_RTOL, atol=OUTPUT_ATOL):
                continue
            summed = _partial_sum(name, want, view, coords)
            if summed is not None and torch.allclose(summed, want, rtol=OUTPUT_RTOL, atol=OUTPUT_ATOL):
                continue  # a partial sum over tp (a rowwise projection's output, reduced further on)
            err = (have - want).abs().max().item()
            return f"{name or '<model>'}{label} (max abs err {err:.3g}, output shape {list(want.shape)})"
    return "none: every comparable forward output agrees, so the error is in backward (a gradient reduction)"


def _pipeline_views(ranks: list[dict], coords: list[dict]) -> list[tuple[str, list[dict]]]:
    """The ranks' outputs once per pipeline rank (the others' masked out), so a module
    that runs on several stages (one outside the decoder layers) is compared on each:
    a later stage may compute it from other inputs than the first. One view without pp."""
    pps = sorted({c.get("pp", 0) for c in coords})
    if len(pps) == 1:
        return [("", ranks)]
    return [(f" on pipeline rank {v}", [outputs if c["pp"] == v else {} for outputs, c in zip(ranks, coords)])
            for v in pps]


def _reference_outputs(spec: CodegenSpec, probe: Probe) -> dict[str, Any]:
    from hyper_parallel.codegen.check.module_outputs import module_outputs

    return module_outputs(reference_model(spec, probe), probe.tokens[:1])


def _holders(name: str, ranks: list[dict]) -> list[int]:
    """The ranks that report ``name``'s output: every rank, or under pipeline parallel the
    ranks of the stage that runs it (the first such stage where two do: tied embeddings)."""
    return [r for r, outputs in enumerate(ranks) if name in outputs]


def _reassemble(name: str, want, ranks: list[dict], coords: list[dict]):
    """The first holder's output, or the pieces of the ranks that differ from it only on
    the axes it is split over (tp; cp and tp; cp), concatenated in mesh order."""
    import torch

    holders = _holders(name, ranks)
    if not holders or want.dim() < 3:
        return None  # 2-D: token rows in routing order (experts), not (batch, sequence, ...)
    locals_ = [outputs.get(name) for outputs in ranks]
    first, home = locals_[holders[0]], coords[holders[0]]
    if first.shape == want.shape:
        return first
    if first.dim() != want.dim():
        return None
    dims = [d for d in range(want.dim()) if first.shape[d] != want.shape[d]]
    if len(dims) != 1 or want.shape[dims[0]] % max(first.shape[dims[0]], 1):
        return None
    dim, pieces = dims[0], want.shape[dims[0]] // first.shape[dims[0]]
    for axes in ((TP,), (CP, TP), (CP,)):
        sizes = [max(c[a] for c in coords) + 1 for a in axes]
        if _product(sizes) != pieces:
            continue
        others = {a: v for a, v in home.items() if a not in axes}
        group = [r for r, c in enumerate(coords) if all(c[a] == v for a, v in others.items())]
        if any(locals_[r] is None for r in group):
            continue
        group.sort(key=lambda r: tuple(coords[r][a] for a in axes))
        whole = torch.cat([locals_[r] for r in group], dim=dim)
        if whole.shape == want.shape:
            return whole
    return None


def _partial_sum(name: str, want, ranks: list[dict], coords: list[dict]):
    """The sum of rank 0's tp group's outputs when each has the reference's full shape: a
    module whose output is a partial sum over tp (``rowwise`` projections, packed experts,
    the blocks around them) hands on a term of the output, not the output."""
    holders = _holders(name, ranks)
    if not holders or "tp" not in coords[0] or max(c["tp"] for c in coords) == 0:
        return None
    others = {a: v for a, v in coords[holders[0]].items() if a != "tp"}
    group = [r for r, c in enumerate(coords) if all(c[a] == v for a, v in others.items())]
    values = [ranks[r].get(name) for r in group]
    if any(value is None or value.shape != want.shape for value in values):
        return None
    return sum(values[1:], values[0])


def _product(values) -> int:
    out = 1
    for value in values:
        out *= value
    return out


# --- launching the ranks -------------------------------------------------------------------------

def _job(spec, bundle_dir: Path, bundle_key: str, files: dict[str, str], model_class: str, tmp: Path, *,
         diagnose: bool, pipeline: dict[str, Any] | None) -> dict:
    p = spec.layout
    tag = "diagnose" if diagnose else "run"
    job = {"bundle_dir": str(bundle_dir), "bundle_key": bundle_key, "files": files, "modeling_file": spec.modeling_file,
           "model_class": model_class, "probe_dir": str(tmp / "probe"), "pipeline": pipeline,
           "attn_implementation": spec.attn_implementation,
           "layout": p.as_dict(),
           "diagnose": diagnose, "mode": verify_mode(p.world_size), "timeout_s": spec.check_timeout_s,
           "result": str(tmp / f"{tag}.pt"), "error": str(tmp / f"{tag}.error"), "path": str(tmp / f"{tag}.json"),
           "rank_files": str(tmp / tag), "preload": rank_preload(spec.source)}
    Path(job["path"]).write_text(json.dumps(job))
    return job


def _launch(job: dict, mode: str, world: int) -> RankLaunch:
    worker = ["-m", "hyper_parallel.codegen.check.verify_worker", "--job", job["path"], "--mode", mode]
    if mode == "torchrun":
        cmd = torchrun_command(world, worker[1], worker[2:], job["preload"])
    else:
        cmd = [sys.executable, *worker, "--world", str(world)]
    return RankLaunch(cmd, log=Path(job["path"]).with_suffix(".log"))


def _finish(launched: RankLaunch, job: dict, mode: str, world: int, spec: CodegenSpec) -> None:
    """Wait for the ranks; a failure names each rank's own error and the silent ones."""
    what = f"verify on {world} ranks ({mode}) for {job['bundle_dir']}"
    try:
        if mode == "threads" and launched.proc.wait(timeout=LAUNCH_TIMEOUT_S) == 0 and Path(job["result"]).is_file():
            return
        if mode == "torchrun":
            wait_for_ranks(launched, RankFiles(job["rank_files"]), world, what=what, timeout_s=LAUNCH_TIMEOUT_S,
                           collective_timeout_s=job["timeout_s"], result=Path(job["result"]))
            return
        merged = Path(job["error"]).read_text().strip() if Path(job["error"]).is_file() else ""
        raise LaunchError(f"{what} failed:\n{merged or last_error_line(launched.output())}")
    except subprocess.TimeoutExpired:
        kill_tree(launched.proc)
        reason = f"{what} did not finish within {LAUNCH_TIMEOUT_S}s; run it by hand: {' '.join(launched.cmd)}"
    except LaunchError as exc:
        reason = str(exc)
    raise VerifyError(f"{reason}\n  the previous bundle is left as it was; fix: `doit generate "
                      f"config={spec.recipe_path}` after correcting the recipe (set HYPER_PARALLEL_TRACEBACK=1 "
                      f"for tracebacks)")


