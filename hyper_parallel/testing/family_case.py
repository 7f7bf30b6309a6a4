"""One family x layout: recipe, generate (with verify), optionally train (see the package
docstring and ``bench/family_sweep.py``'s docstring for the statuses).
"""

import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hyper_parallel.codegen.spec.types import STAGES
from hyper_parallel.launch.ranks import RANK_PREFIX, exit_text, rank_exits, rank_stderr_lines
from hyper_parallel.testing.tiny_families import REPO, family_dir, is_remote
from hyper_parallel.trainer.metrics import read_metrics
from hyper_parallel.trainer.reference import reference_training

# layout -> accelerator keys; ep is borrowed from dp*cp, so ep2 needs dp2.
LAYOUTS = {
    "tp2": {"tp_size": 2},
    "tp2_sp_lp": {"tp_size": 2, "sequence_parallel": True, "loss_parallel": True},
    "cp2": {"cp_size": 2},
    "cp4": {"cp_size": 4},
    "tp2_cp2": {"tp_size": 2, "cp_size": 2},
    "dp2_cp2": {"dp_size": 2, "cp_size": 2},
    # context parallel splitting attention: K/V all-gathered over cp, load-balanced chunks
    "cp2_kv": {"cp_size": 2, "context_parallel": {"algorithm": "allgather_kv", "load_balance": True}},
    "cp2_gather": {"cp_size": 2, "context_parallel": {"algorithm": "gather_sequence"}},
    "cp2_ulysses": {"cp_size": 2, "context_parallel": {"algorithm": "ulysses"}},
    "dp2": {"dp_size": 2},
    "ep2": {"dp_size": 2, "ep_size": 2},
    "tp2_ep2": {"tp_size": 2, "dp_size": 2, "ep_size": 2},
}
MOE_LAYOUTS = ("ep2", "tp2_ep2")
TRAIN_STEPS, LOSS_RTOL, NORM_RTOL = 3, 1e-5, 1e-4
# The most AdamW's measured rounding noise may widen a later step's tolerance to: a noisy
# reference that wanders further (an unstable model) proves nothing about the parallel run.
NOISE_CAP = 1e-2

# The project's own "cannot plan this" errors: a clean refusal when raised before emit or by
# verify's probe, and the CLI exits EXIT_REFUSED for them. Anything else (TypeError,
# KeyError, a VerifyError, ...) is a fault.
REFUSAL_ERRORS = {"DeriveError", "PlanError", "UnclassifiedModule", "FreezeError", "PlanFormatError",
                  "PlacementTextError", "SourceError", "RecipeError", "ProbeError"}
REFUSAL_STAGES = ("resolve", "derive", "freeze")
EXIT_REFUSED = 2  # python -m hyper_parallel.codegen: bad input and the project's refusals
# An exception's line: a class named ...Error/Exception/Exit/Interrupt, or one of the
# project's refusal classes named otherwise (UnclassifiedModule).
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|UnclassifiedModule)\w*): ?(.*)$")


@dataclasses.dataclass
class Case:
    """One row: status pass / refused / fail, its one-line reason, and the seconds spent."""
    family: str
    layout: str
    status: str = ""
    reason: str = ""
    generate_s: float = 0.0
    train_s: float = 0.0


def clean_env() -> dict:
    """Subprocesses run as a user's shell would: no torchrun variables, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def run_bounded(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` capturing text output, but a timeout kills the whole process group:
    torchrun's ranks (hung in a collective, say) die with it instead of living on. Raises
    ``subprocess.TimeoutExpired`` carrying what was printed until then."""
    proc = subprocess.Popen(command, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def make_project(dest: Path) -> Path:
    """A throwaway project: dodo.py as bench/gen_vs_peer.py's make_project copies it, and an
    empty recipes/ that the sweep fills (one folder per family, one per layout below it)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dodo.py", dest / "dodo.py")
    (dest / "recipes").mkdir(exist_ok=True)
    return dest


def world_of(layout: str) -> int:
    acc = LAYOUTS[layout]
    return acc.get("tp_size", 1) * acc.get("cp_size", 1) * acc.get("dp_size", 1)


def layouts_for(family: str, moe: bool, layouts: list[str]) -> list[str]:
    """The requested layouts that apply: ep layouts only for MoE families."""
    return [layout for layout in layouts if moe or layout not in MOE_LAYOUTS]


def write_recipe(project: Path, family: str, layout: str) -> Path:
    """recipes/<family>/<layout>/recipe.yaml next to recipes/<family>/model (the checkpoint);
    the shape of recipes/tiny_cpu/qwen3_moe_tiny.yaml, with this layout's parallel sizes
    (and ``model.trust_remote_code: true`` for a remote-code fixture)."""
    world = world_of(layout)
    dp = LAYOUTS[layout].get("dp_size", 1)
    data = {
        "model": {"pretrained_model_name_or_path": "../model", "torch_dtype": "float32",
                  "attn_implementation": "eager", **({"trust_remote_code": True} if is_remote(family) else {})},
        "accelerator": {"device_type": "cpu", "nproc_per_node": world, "nnodes": 1, "tp_size": 1,
                        **LAYOUTS[layout]},
        "codegen": True,
        "training": {"steps": TRAIN_STEPS, "global_batch_size": 2 * dp, "micro_batch_size": 1, "seq_len": 16,
                     "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
    }
    recipe = project / "recipes" / family_dir(family) / layout / "recipe.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def run_case(project: Path, case: Case, *, timeout: float = 600, train: bool = True) -> Case:
    """Generate (with verify), then train (``train``) when it generated. The family's
    checkpoint must be at ``recipes/<family_dir>/model`` of ``project`` (``save_checkpoint``)."""
    recipe = write_recipe(project, case.family, case.layout)
    start = time.perf_counter()
    code, output = run_generate(project, recipe, timeout)
    case.generate_s = time.perf_counter() - start
    case.status, case.reason = classify_generate(code, output, project, timeout)
    (recipe.parent / "generate.log").write_text(output)
    if case.status == "pass" and train:
        start = time.perf_counter()
        case.status, case.reason = run_training(project, recipe, world_of(case.layout), timeout)
        case.train_s = time.perf_counter() - start
    unapplied = re.findall(r"note: (\w+) not applied:", output)
    if case.status == "pass" and unapplied:  # a pass of the layout without that axis: the row says so
        case.reason = "; ".join([*filter(None, [case.reason]), f"{', '.join(unapplied)} not applied (derive's note)"])
    return case


def run_generate(project: Path, recipe: Path, timeout: float) -> tuple[int | None, str]:
    """The CLI with --verbose (tracebacks name the exception class); (exit code or None on
    timeout, stdout + stderr)."""
    command = [sys.executable, "-m", "hyper_parallel.codegen", "--verbose", "generate",
               "--config", str(recipe.relative_to(project))]
    try:
        proc = run_bounded(command, project, timeout)
    except subprocess.TimeoutExpired as exc:
        return None, _text(exc.stdout) + _text(exc.stderr)
    return proc.returncode, proc.stdout + proc.stderr


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def failed_stage(output: str) -> str:
    """The first stage that neither finished nor was up to date (the verbose log's lines)."""
    for stage in STAGES:
        if not re.search(rf"^(\. {stage} done|-- {stage} up to date)", output, re.M):
            return stage
    return "?"


def final_exception(output: str) -> tuple[str, str]:
    """(class name, message) of the exception that stopped the run: under torchrun the first
    rank's own (``[rankN]: XError: ...``), else the last one a traceback printed (not
    torchrun's ChildFailedError, which only says that a rank failed)."""
    ranked, plain = [], []
    for line in output.splitlines():
        rank = re.match(r"^\[rank\d+\]: ?(.*)$", line)
        text = rank.group(1) if rank else line
        match = EXCEPTION_LINE.match(text) if not text.startswith(" ") else None
        if match and match.group(1).rsplit(".", 1)[-1] != "ChildFailedError":
            (ranked if rank else plain).append((match.group(1).rsplit(".", 1)[-1], match.group(2)))
    found = ranked[:1] or plain[-1:]
    return found[0] if found else ("", "")


def error_message(output: str) -> str:
    """The CLI's own ``error: ...`` text (up to the next blank or indented-fix line)."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("error: "):
            return "\n".join([line[len("error: "):], *lines[index + 1:index + 8]])
    return ""


def classify_generate(code: int | None, output: str, project: Path, timeout: float) -> tuple[str, str]:
    """pass / refused / fail and a one-line reason (see the module docstring)."""
    if code == 0:
        return "pass", ""
    if code is None:
        return "fail", f"generate timed out after {timeout:.0f}s in {failed_stage(output)}"
    stage = failed_stage(output)
    kind, _ = final_exception(output)
    message = error_message(output).replace(str(project) + "/", "").replace(str(project), "<project>")
    message = re.sub(r"^recipes/\S+/recipe\.yaml: ", "", message)  # the row names family and layout
    refusal = kind in REFUSAL_ERRORS and (stage in REFUSAL_STAGES or kind == "ProbeError")
    if refusal and code == EXIT_REFUSED:
        return "refused", f"{stage}: {first_line(message, 300)}"
    if refusal:  # a refusal's error class, but the CLI did not report it as one
        return "fail", f"{stage}: {kind} with exit code {code}, not {EXIT_REFUSED}: {first_line(message)}"
    if kind == "VerifyError" or stage == "verify":
        return "fail", f"verify: {verify_reason(message)}"
    label = f"{kind} (exit {code})" if kind else f"exit {code}"
    return "fail", f"{stage}: {label}: {first_line(message)}"


def verify_reason(message: str) -> str:
    """A verify failure in one line: what differed, and where it first diverged or which
    rank's error stopped it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = re.sub(r"^verify failed for \S+ \(world \d+, \w+\) at ", "", lines[0]) if lines else ""
    head = re.sub(r"^verify on \d+ ranks \(\w+\) for \S+ failed:?", "ranks failed:", head)
    # A rank that went silent is reported first; the error of the rank that did fail (its
    # crash usually stopped the other) says more.
    rank_error = next((line for line in lines[1:] if re.match(r"ranks? [\d, ]+: \S", line)), None)
    silent = next((line.split(";")[0] for line in lines[1:] if "went silent" in line), None)
    extra = next((line for line in lines[1:] if line.startswith("first module")), None) \
        or (f"{rank_error} (and {silent})" if rank_error and silent else rank_error) \
        or next((line for line in lines[1:] if not line.startswith("the previous bundle")), "")
    joined = f"{head} {extra}" if head.endswith(":") else f"{head}; {extra}"
    joined = joined.replace(" in  (no plan entry)", " in <root> (no plan entry)")  # the model's own forward
    return first_line(compact_plan_entries(joined if extra else head), 400)


def compact_plan_entries(text: str) -> str:
    """``plan entry 'K': {'role': 'R', ...}`` -> ``plan entry 'K' (role R)``: the dict is in
    the generate log; the role says what the planner thought the module was."""
    out, start = [], 0
    for match in re.finditer(r"plan entry '[^']*': \{", text):
        if match.start() < start:
            continue
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        role = re.search(r"'role': '(\w+)'", text[match.end() - 1:end + 1])
        out.append(text[start:match.start()] + match.group(0)[:-3] + (f" (role {role.group(1)})" if role else ""))
        start = end + 1
    return "".join(out) + text[start:]


def run_training(project: Path, recipe: Path, world: int, timeout: float) -> tuple[str, str]:
    """The gen backend trains TRAIN_STEPS steps under torchrun (the installed bundle, each
    rank reading its checkpoint slices); single-process HF trains the same steps here."""
    metrics = recipe.parent / "metrics.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "hyper_parallel.trainer", "--config", str(recipe), "--metrics", str(metrics)]
    try:
        proc = run_bounded(command, project, timeout)
    except subprocess.TimeoutExpired:
        return "fail", f"train: timed out after {timeout:.0f}s"
    if proc.returncode != 0 or not metrics.is_file():
        return "fail", training_crash(proc.returncode, proc.stdout, proc.stderr, metrics.is_file(), project)
    got = read_metrics(metrics)
    want = reference_training(recipe)
    status, reason = compare_training(got, want)
    if status == "fail":  # measured only when needed: is the deviation AdamW's rounding noise?
        status, reason = compare_training(got, want, reference_training(recipe, rounding_noise=True))
    return status, reason


STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|", re.M)  # the trainer's progress lines


def training_crash(code: int, stdout: str, stderr: str, metrics_written: bool, project: Path) -> str:
    """Why the training launch failed, never empty: torchrun's exit code, the rank that
    failed first and how (signal names for negative codes), how far training got, and the
    rank's exception or else the last lines of the ranks' stderr."""
    parts = [f"torchrun {exit_text(code)}" if code else "torchrun exit 0 but rank 0 wrote no metrics"]
    exits = rank_exits(stderr)
    if exits:
        rank, rank_code = exits[0]
        parts.append(f"rank {rank} {exit_text(rank_code)}"
                     + (f" (also {', '.join(f'rank {r} {exit_text(c)}' for r, c in exits[1:])})" if exits[1:] else ""))
    steps = STEP_LINE.findall(stdout)
    if steps:
        done, total = steps[-1]
        parts.append(f"after step {done}/{total}" + (", metrics written" if metrics_written else ""))
    kind, message = final_exception(stdout + "\n" + stderr)
    lines = rank_stderr_lines(stderr)
    # A rank killed by a signal prints no traceback; what it printed last (e.g. "terminate
    # called without an active exception") says more than the others' "connection closed".
    unranked = [line for line in lines if not RANK_PREFIX.match(line)]
    if exits and exits[0][1] < 0 and unranked:
        detail = " | ".join(unranked[-3:])
    elif kind:
        detail = f"{kind}: {message}"
    else:
        tail = lines[-3:] or [line.strip() for line in stdout.splitlines() if line.strip()][-2:]
        detail = " | ".join(tail) if tail else "no output"
    detail = detail.replace(str(project) + "/", "").replace(str(project), "<project>")
    return first_line(f"train (gen backend) crashed: {'; '.join(parts)}: {detail}", 400)


def compare_training(got: list[dict], want: list[dict], noisy: list[dict] | None = None) -> tuple[str, str]:
    """Loss rtol LOSS_RTOL and gradient norm rtol NORM_RTOL at every step.

    With ``noisy`` (one process trained again with rounding-sized noise on its gradients,
    ``reference_training(rounding_noise=True)``) a step after the first may also deviate as
    far as that run deviates from the plain one: on some models AdamW carries fp32 rounding
    (what any other summation order leaves) past 1e-4 within two steps; by at most NOISE_CAP.
    The first step, which no optimizer step precedes, stays strict either way; a loss or
    gradient norm that is not finite fails."""
    if len(got) != len(want):
        return "fail", f"train: {len(got)} steps logged, expected {len(want)}"
    worst_loss = worst_norm = noise_loss = noise_norm = 0.0
    for step, (have, ref) in enumerate(zip(got, want), start=1):
        loss_rel, norm_rel = relative_deviation(have, ref)
        worst_loss, worst_norm = max(worst_loss, loss_rel), max(worst_norm, norm_rel)
        loss_tol, norm_tol = LOSS_RTOL, NORM_RTOL
        if noisy is not None and step > 1:
            floor_loss, floor_norm = relative_deviation(noisy[step - 1], ref)
            noise_loss, noise_norm = max(noise_loss, floor_loss), max(noise_norm, floor_norm)
            loss_tol, norm_tol = max(loss_tol, min(floor_loss, NOISE_CAP)), max(norm_tol, min(floor_norm, NOISE_CAP))
        finite = math.isfinite(have["loss"]) and math.isfinite(have["grad_norm"])
        if not finite or not loss_rel <= loss_tol or not norm_rel <= norm_tol:
            noise = f"; one process with rounding noise: loss rel {floor_loss:.1e}, grad norm rel {floor_norm:.1e}" \
                if noisy is not None and step > 1 else ""
            return "fail", (f"train step {step}: loss {have['loss']:.7g} vs one process {ref['loss']:.7g} "
                            f"(rel {loss_rel:.1e}), grad norm {have['grad_norm']:.6g} vs {ref['grad_norm']:.6g} "
                            f"(rel {norm_rel:.1e}){noise}")
    reason = f"train {len(got)} steps: loss rel <= {worst_loss:.0e}, grad norm rel <= {worst_norm:.0e}"
    if noisy is not None:
        reason += (f", within AdamW's rounding noise on this model (one process with fp32 rounding noise "
                   f"on its gradients: loss rel {noise_loss:.0e}, grad norm rel {noise_norm:.0e})")
    return "pass", reason


def relative_deviation(have: dict, ref: dict) -> tuple[float, float]:
    """(loss, gradient norm) relative deviation of one step's record from the reference's."""
    return (abs(have["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12),
            abs(have["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12))


def first_line(text: str, limit: int = 240) -> str:
    """An error message as one trimmed line for a table cell; a first line ending in ':'
    (a heading over a list of problems) takes the lines under it."""
    lines = [part.strip() for part in text.strip().splitlines() if part.strip()]
    line = lines[0] if lines else ""
    if line.endswith(":") and len(lines) > 1:
        line = " ".join(lines)
    return line if len(line) <= limit else line[:limit - 3] + "..."
