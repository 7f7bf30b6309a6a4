"""Coverage sweep: every decoder family transformers ships, generated and verified per layout.

    python bench/family_sweep.py                                 # every kept family, every layout
    python bench/family_sweep.py --families llama,qwen3,mixtral --layouts tp2,cp2
    python bench/family_sweep.py --list                          # kept and skipped families only
    python bench/family_sweep.py --families llama --keep /tmp/sweep --no-docs
    python bench/family_sweep.py --remote-only --no-peer           # the remote-code fixtures only
    python bench/family_sweep.py --families remote:list_moe --layouts ep2
    python bench/family_sweep.py --journal /tmp/sweep.jsonl --keep /tmp/sweep   # resumable; rerun to continue
    python bench/family_sweep.py --journal /tmp/sweep.jsonl --keep /tmp/sweep --redo fail

What it does (issue 11, items 1 and 2):

1. Families. Every model type in transformers' causal-LM auto mapping
   (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``). Kept: attention-based, decoder-only text LMs.
   Skipped, each with its reason: encoder-decoder models and the decoder halves of them,
   encoders with an LM head (attention not causal by default), multimodal or otherwise
   composite configs (their text model is usually its own ``*_text`` type), speculative-decoding
   assistants, and types whose tiny model cannot be built offline. State-space, recurrent,
   linear-attention and short-convolution decoders (and hybrids of them with attention) are
   swept like every decoder: each layout a pass, a refusal naming what cannot be planned, or a fail.
2. A tiny config per family, built from its config class (``tiny_config``): hidden 64,
   4 heads with 2 kv heads where the class has ``num_key_value_heads``, head_dim 16,
   intermediate 128 (experts 32), vocabulary 256, 4 experts with top-k 2, 2-4 layers chosen
   so that every distinct layer kind of the family's default depth appears (sliding/full,
   dense/MoE, ...). Random weights are saved with ``save_pretrained``, so the checkpoint has
   the tensor names transformers really writes.
3. Per family and layout (``tp2``, ``tp2_sp_lp``, ``cp2``, ``dp2``; for MoE families also
   ``ep2`` = dp2 + ep2 and ``tp2_ep2`` = tp2 + dp2 + ep2 at world 4; ep is borrowed from
   dp*cp) a recipe in a throwaway project and ``python -m hyper_parallel.codegen --verbose
   generate``, every stage a user gets, preflight included (issue 51: a sweep that skipped
   preflight missed a plan reader that disagreed with the applier). Generate runs the verify stage: the bundle at the recipe's
   world size against single-process HF on a shrunk probe, two AdamW steps, loss (rtol 1e-5)
   and every parameter's gradient (rtol 1e-4). Then, for rows that generated, the gen
   backend trains the saved checkpoint for 3 AdamW steps under torchrun
   (``hyper_parallel.trainer``; each rank reads its slices of the checkpoint) against
   single-process HF training on the same data: loss rtol 1e-5 and gradient norm rtol 1e-4
   at every step (``--no-train`` skips this). When a step after the first is further off,
   single-process HF trains again with fp32-rounding-sized noise on its gradients
   (``reference_training(rounding_noise=True)``); the row passes when its deviation is within
   that run's (AdamW's own sensitivity to rounding on this model), and says so. Step 1 stays
   strict.
   Status: ``pass`` (generated, verified, trained equal); ``refused`` (generate exited 2,
   the CLI's code for bad input and the project's refusals, with one of the project's own
   error classes from resolve / derive / freeze or the verify probe, i.e. a clean error
   naming a module or key); ``fail`` (anything else: a verify mismatch, a crash in a stage
   or in verify's ranks, a refusal-class error with another exit code, a training mismatch
   or crash, a timeout). A training crash's reason names torchrun's exit code, the rank that
   failed first and how (``killed by SIGABRT (exit -6)``), the last step logged, and the
   rank's exception or else the last lines the ranks wrote to stderr.
4. Remote-code fixtures. Every folder of ``tests/data/remote_code/`` (a config.json with an
   ``auto_map``, its ``configuration_*.py`` and ``modeling_*.py``) is swept too, as family
   ``remote:<folder>``: decoders transformers does not ship, with module names and block
   structures no transformers family has. The fixture's own config.json is its tiny
   config; its checkpoint is written by ``save_pretrained`` of
   ``AutoModelForCausalLM.from_config(..., trust_remote_code=True)`` (which copies the
   code beside the weights), and its recipes set ``model.trust_remote_code: true``. A
   fixture with experts gets the MoE layouts. ``--remote-only`` runs only these (and does
   not enumerate transformers' families); the summary counts them apart from the kept
   transformers families.
5. Peer column: the same checkpoints through transformers' own
   ``from_pretrained(dir, tp_plan="auto")`` at tp2 (torchrun, world 2, gloo; several
   families per launch, ``bench/family_sweep_worker.py``) against single-process HF, 3 AdamW
   steps in training mode with each step's random state seeded alike, loss rtol 1e-5 and gradient norm rtol 1e-4 (widened past step 1 to AdamW's rounding
   noise, as for the rows): ``pass`` / ``fail`` / ``unsupported``
   (the config has no ``base_model_tp_plan``; so for a remote-code fixture unless it
   defines one).

Resuming (``--journal PATH``): every finished case and peer result is appended to PATH as
one JSON line (with the commit it ran at), as soon as it finishes. A later run with the same
journal runs only the selected cases the journal does not have (``--redo fail,refused``: also
the ones recorded with those statuses; their new line replaces the old), and reports every
selected case from the journal, so a sweep can be stopped and continued, or a fault fixed and
only its rows run again. Rows of one report that ran at different commits are listed as such
in the docs. Lines run with or without training are kept apart (a ``--no-train`` pass is not
a trained pass). ``--keep DIR`` keeps the checkpoints too (an existing one is reused).

Prints a table and a summary line; writes ``docs/families.md`` and ``docs/families.json``
(``--no-docs``: don't) with exactly the rows that were run: a run over fewer families or
layouts than the full sweep says so ("partial run") in both the summary and the docs.
The tiny configs and checkpoints (``hyper_parallel/testing/tiny_families.py``) and one
case's recipe, generate and training (``hyper_parallel/testing/family_case.py``) live in
the package: the test suite's fast subset (``tests/families/test_family_subset.py``, 8
families at tp2 and cp2) runs the same code. Progress goes to stderr, one line per case with its seconds. Runs
subprocesses with OMP_NUM_THREADS=1 and no torchrun variables; ``--jobs N`` runs N cases at
a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# The tiny configs and the case runner live in the package (hyper_parallel/testing/), so the
# test suite's family subset (tests/families/test_family_subset.py) runs the same code.
from hyper_parallel.testing.family_case import (
    LAYOUTS,
    MOE_LAYOUTS,
    TRAIN_STEPS,
    Case,
    compare_training,
    final_exception,
    first_line,
    layouts_for,
    make_project,
    run_bounded,
    run_case,
)
from hyper_parallel.testing.tiny_families import (
    REMOTE_PREFIX,
    class_defaults,
    family_dir,
    is_composite,
    is_moe,
    is_remote,
    meta_model,
    remote_families,
    save_checkpoint,
    tiny_config,
)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "family_sweep_worker.py"
DOCS_MD, DOCS_JSON = REPO / "docs" / "families.md", REPO / "docs" / "families.json"
REGENERATE = "python bench/family_sweep.py"

# --- which families are swept ------------------------------------------------------------------

MULTIMODAL_SUBCONFIG = re.compile(r"vision|audio|vq|speech|image|text_config|encoder|decoder|patcher")
# Decided by reading the modeling code; no config flag says so.
SKIP_BY_READING = {
    "xlnet": "permutation LM with two-stream relative attention (XLNetRelativeAttention), not a causal decoder",
    "trocr": "decoder half of an encoder-decoder (TrOCR, the text decoder of a VisionEncoderDecoder)",
    "gemma4_assistant": "speculative-decoding assistant: reads a backbone's hidden states and shared KV "
                        "(pre_projection of 2 x backbone_hidden_size), not a standalone LM",
    "gemma4_unified_assistant": "speculative-decoding assistant: reads a backbone's hidden states and shared KV, "
                                "not a standalone LM",
}


def modeling_module(family: str):
    """The family's modeling module (what resolve reads), by the auto mapping's naming."""
    name = model_type_to_module_name(family)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def module_classes(family: str) -> list[str]:
    """The nn.Module classes the family's modeling module defines itself."""
    try:
        module = modeling_module(family)
    except ImportError:
        return []
    return sorted(name for name, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and issubclass(cls, torch.nn.Module))


def skip_reason(family: str) -> str | None:
    """Why a type of the causal-LM mapping is not an attention-based decoder-only text LM
    (or cannot be built offline); None when it is swept."""
    if family in SKIP_BY_READING:
        return SKIP_BY_READING[family]
    config_class = CONFIG_MAPPING[family]
    subs = sorted(getattr(config_class, "sub_configs", {}) or {})
    if any(MULTIMODAL_SUBCONFIG.search(name) for name in subs) and not is_composite(family):
        return f"composite/multimodal config ({', '.join(subs)})"
    defaults = class_defaults(config_class)
    if defaults.get("is_encoder_decoder") is True:
        return "encoder-decoder (is_encoder_decoder=True); its causal-LM class is the decoder half"
    classes = module_classes(family)
    if defaults.get("is_decoder") is False and any(name.endswith("Encoder") for name in classes):
        return "encoder with an LM head (is_decoder=False by default; a bidirectional encoder stack)"
    try:
        model = meta_model(tiny_config(family))
    except Exception as exc:  # recorded: the type cannot be built offline
        return f"cannot build a tiny model offline: {type(exc).__name__}: {first_line(str(exc))}"
    causal = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if causal and not any(causal):
        return "encoder with an LM head (self-attention is not causal by default, is_decoder=False)"
    if getattr(model.config, "is_encoder", False):
        return "encoder (masked LM; config.is_encoder=True)"
    return None


def enumerate_families() -> tuple[list[str], dict[str, str]]:
    """(kept families sorted, {skipped family: reason})."""
    kept, skipped = [], {}
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        reason = skip_reason(family) if family in CONFIG_MAPPING else "no config class in CONFIG_MAPPING"
        if reason is None:
            kept.append(family)
        else:
            skipped[family] = reason
    return kept, skipped


# --- peer column: transformers' tp_plan="auto" at tp2 --------------------------------------------


def run_peer(project: Path, families: list[str], timeout: float, journal: Journal,
             redo: set[str]) -> dict[str, tuple[str, str]]:
    """{family: (status, reason)}. Families without a base_model_tp_plan are "unsupported";
    the rest run in as few torchrun launches as the failures allow. Journaled results are
    reused unless their status is in ``redo``."""
    results, cases = {}, []
    for family in families:
        old = journal.peer.get(family)
        if old is not None and old["status"] not in redo:
            results[family] = (old["status"], old["reason"])
            continue
        model_dir = project / "recipes" / family_dir(family) / "model"
        config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=is_remote(family))
        if not getattr(config, "base_model_tp_plan", None):
            results[family] = ("unsupported", "the config has no base_model_tp_plan")
            journal.record_peer(family, *results[family])
        else:  # the worker names its files after "family": no ":" in it; "name" is the row's
            cases.append({"family": family_dir(family), "model_dir": str(model_dir),
                          "trust_remote_code": is_remote(family), "name": family})
    out = project / "peer"
    out.mkdir(exist_ok=True)
    while cases:
        start = time.perf_counter()
        tail = launch_peer(cases, out, timeout * len(cases))
        for case in list(cases):
            family, files = case["name"], case["family"]
            result = read_peer_result(out, files)
            if result is None and (out / f"{files}.started").is_file():
                result = {"error": f"the launch ended in this case: {tail or 'timed out'}"}
            if result is None:
                break  # not reached: the next launch runs it
            results[family] = judge_peer(result)
            journal.record_peer(family, *results[family])
            cases.remove(case)
            progress(f"peer {family}: {results[family][0]}", time.perf_counter() - start)
    return results


def launch_peer(cases: list[dict], out: Path, timeout: float) -> str:
    """One torchrun (world 2) over ``cases``; returns the last error line when it failed."""
    for path in out.glob("*.started"):
        path.unlink()
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               "--cases", str(out / "cases.json"), "--out", str(out)]
    try:
        proc = run_bounded(command, REPO, timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s"
    if proc.returncode == 0:
        return ""
    kind, message = final_exception(proc.stdout + proc.stderr)
    return first_line(f"{kind}: {message}") if kind else f"torchrun exit {proc.returncode}"


def read_peer_result(out: Path, family: str) -> dict | None:
    """Rank 0's result, or any rank's error."""
    results = [json.loads(path.read_text()) for path in sorted(out.glob(f"{family}.rank*.json"))]
    errors = [r for r in results if "error" in r]
    return errors[0] if errors else (results[0] if results else None)


def judge_peer(result: dict) -> tuple[str, str]:
    """pass when the peer really sharded (tp 2) and matched one process at every step."""
    if "error" in result:
        return "fail", first_line(result["error"])
    if result.get("tp_size") != 2 or not result.get("sharded"):
        return "unsupported", f"tp_plan='auto' sharded nothing (tp_size {result.get('tp_size')})"
    status, reason = compare_training(result["peer"], result["reference"])
    if status == "fail" and "reference_noisy" in result:  # the rows' rule: AdamW's rounding noise
        status, reason = compare_training(result["peer"], result["reference"], result["reference_noisy"])
    return status, reason.replace("train", "tp_plan='auto'", 1)


# --- reporting ---------------------------------------------------------------------------------


def progress(message: str, seconds: float) -> None:
    print(f"[{seconds:6.1f}s] {message}", file=sys.stderr, flush=True)


# --- the journal (--journal): resumable sweeps -------------------------------------------------


def current_commit() -> str:
    """The repository's commit, ``+dirty`` when the package or the bench differ from it."""
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--", "hyper_parallel", "bench") else "")


class Journal:
    """JSON lines of finished cases ({"case": ...}) and peer results ({"peer": ...}); the
    last line for a key wins. ``path`` None: nothing is read or written."""

    def __init__(self, path: str | None, trained: bool):
        self.path, self.trained, self.commit = (Path(path) if path else None), trained, current_commit()
        self.cases: dict[tuple[str, str], dict] = {}
        self.peer: dict[str, dict] = {}
        self._lock = threading.Lock()  # --jobs: cases finish on several threads
        if self.path is not None and self.path.is_file():
            for number, line in enumerate(self.path.read_text().splitlines(), start=1):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: that case runs again
                    print(f"{self.path}:{number}: not JSON, ignored", file=sys.stderr)
                    continue
                if "case" in entry and entry["case"].get("trained") == trained:
                    self.cases[(entry["case"]["family"], entry["case"]["layout"])] = entry["case"]
                elif "peer" in entry:
                    self.peer[entry["peer"]["family"]] = entry["peer"]

    def wanted(self, case: Case, redo: set[str]) -> bool:
        """Whether ``case`` runs: not journaled yet, or journaled with a status in ``redo``."""
        old = self.cases.get((case.family, case.layout))
        return old is None or old["status"] in redo

    def restore(self, case: Case) -> Case:
        old = self.cases[(case.family, case.layout)]
        case.status, case.reason = old["status"], old["reason"]
        case.generate_s, case.train_s = old.get("generate_s", 0.0), old.get("train_s", 0.0)
        return case

    def record_case(self, case: Case) -> None:
        entry = {"family": case.family, "layout": case.layout, "status": case.status, "reason": case.reason,
                 "generate_s": round(case.generate_s, 1), "train_s": round(case.train_s, 1),
                 "trained": self.trained, "commit": self.commit}
        self.cases[(case.family, case.layout)] = entry
        self._append({"case": entry})

    def record_peer(self, family: str, status: str, reason: str) -> None:
        self.peer[family] = {"family": family, "status": status, "reason": reason, "commit": self.commit}
        self._append({"peer": self.peer[family]})

    def commits(self, cases: list[Case]) -> dict[str, list[str]]:
        """{commit: ["family layout", ...]} of the reported cases (this run's commit for unjournaled)."""
        found: dict[str, list[str]] = {}
        for case in cases:
            commit = self.cases.get((case.family, case.layout), {}).get("commit", self.commit)
            found.setdefault(commit, []).append(f"{case.family} {case.layout}")
        return found

    def _append(self, entry: dict) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, self.path.open("a") as out:  # one write per line: a kill loses at most this line
                out.write(json.dumps(entry) + "\n")


def summary_line(cases: list[Case], peer: dict, kept: int | None, skipped: int, run_note: str,
                 remote: int = 0) -> str:
    """``families: N kept (M skipped); tp2 pass X/R (P%), ...; remote-code fixtures: K; tp2
    pass ...; zero-fail: yes/no; transformers V``. transformers' families and the remote-code
    fixtures are counted apart; ``kept`` None: transformers' families were not enumerated
    (--remote-only)."""
    sections = []
    for label, ours, count in (("families", lambda f: not is_remote(f), kept),
                               ("remote-code fixtures", is_remote, remote if remote else None)):
        if count is None:
            continue
        parts = pass_counts([c for c in cases if ours(c.family)])
        their_peer = [status for family, (status, _) in peer.items() if ours(family)]
        if their_peer:
            parts.append(f"peer tp2 pass {their_peer.count('pass')}/{len(their_peer)}")
        head = f"{label}: {count} kept ({skipped} skipped)" if label == "families" else f"{label}: {count}"
        sections.append("; ".join([head, ", ".join(parts)] if parts else [head]))
    zero_fail = "yes" if not any(c.status == "fail" for c in cases) else "no"
    return f"{'; '.join(sections)}; zero-fail: {zero_fail}; transformers {transformers.__version__}{run_note}"


def pass_counts(cases: list[Case]) -> list[str]:
    """``tp2 pass X/R (P%)`` per layout that has rows."""
    parts = []
    for layout in LAYOUTS:
        rows = [c for c in cases if c.layout == layout]
        if rows:
            passed = sum(c.status == "pass" for c in rows)
            parts.append(f"{layout} pass {passed}/{len(rows)} ({100 * passed / len(rows):.0f}%)")
    return parts


def status_cell(case: Case | None) -> str:
    """The row's status; "pass (ep not applied)" where the layout passed without an axis it
    asks for (derive recorded it: nothing in the model could be placed on it)."""
    if case is None:
        return ""
    unapplied = re.search(r"(\w+(?:, \w+)*) not applied \(derive's note\)", case.reason or "")
    if case.status == "pass" and unapplied:
        return f"pass ({unapplied.group(1)} not applied)"
    return {"pass": "pass", "refused": "refused", "fail": "**FAIL**"}[case.status]


def result_table(families: list[str], layouts: list[str], cases: list[Case], peer: dict, moe: dict) -> list[str]:
    """Markdown: family x layout -> status, and the peer column ("n/a": layout does not apply)."""
    by_key = {(c.family, c.layout): c for c in cases}
    header = ["family", "moe", *layouts] + (["peer tp2"] if peer else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in families:
        cells = [family, "yes" if moe[family] else ""]
        for layout in layouts:
            applies = moe[family] or layout not in MOE_LAYOUTS
            cells.append(status_cell(by_key.get((family, layout))) if applies else "n/a")
        if peer:
            cells.append(peer.get(family, ("", ""))[0])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def print_report(families, layouts, cases, peer, moe, summary) -> None:
    """The table and every non-pass row's reason on stdout, then the summary line."""
    width = max(len(f) for f in families)
    print(f"{'family':{width}}  " + "  ".join(f"{name:9}" for name in [*layouts, *(["peer"] if peer else [])]))
    by_key = {(c.family, c.layout): c for c in cases}
    for family in families:
        cells = [(by_key[(family, l)].status if (family, l) in by_key else "n/a") for l in layouts]
        if peer:
            cells.append(peer.get(family, ("",))[0])
        print(f"{family:{width}}  " + "  ".join(f"{cell:9}" for cell in cells))
    for case in cases:
        if case.status != "pass":
            print(f"  {case.status:7} {case.family} {case.layout}: {case.reason}")
    for family, (status, reason) in peer.items():
        if status != "pass":
            print(f"  peer {status} {family}: {reason}")
    print(summary)


def write_docs(md_path: Path, json_path: Path | None, *, families, layouts, cases, peer, moe, skipped, summary,
               command: str, partial: str, commits: str = "") -> None:
    """docs/families.md and the JSON (exactly transformers / rows / peer / skipped)."""
    data = {
        "transformers": transformers.__version__,
        "rows": [{"family": c.family, "layout": c.layout, "status": c.status, "reason": c.reason} for c in cases],
        "peer": [{"family": f, "status": peer[f][0]} for f in families if f in peer],
        "skipped": [{"family": f, "reason": r} for f, r in sorted(skipped.items())],
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(docs_markdown(families, layouts, cases, peer, moe, skipped, summary, command, partial,
                                         commits))


def docs_markdown(families, layouts, cases, peer, moe, skipped, summary, command, partial, commits="") -> str:
    """The page: how it was made and what it means, then the tables."""
    return "\n".join([*docs_header(summary, command, partial, cases, peer, commits),
                      *docs_tables(families, layouts, cases, peer, moe, skipped)]) + "\n"


def docs_header(summary, command, partial, cases, peer, commits="") -> list[str]:
    """Provenance, the partial-run note, the summary and the meaning of each status."""
    lines = [
        "# Decoder families: generate, verify and train per layout",
        "",
        f"Written by `{command}` (transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, "
        f"CPU, gloo). The full sweep is `{REGENERATE}`; the bench's docstring says what is measured.",
        "",
    ]
    if partial:
        lines += [f"> **Partial run.** {partial} Families and layouts not listed below were not run.", ""]
    if commits:
        lines += [f"> **Commits.** {commits}", ""]
    lines += [f"**Summary:** {summary}", ""]
    behind = sorted({c.family for c in cases if c.layout == "tp2" and c.status != "pass"
                     and peer.get(c.family, ("",))[0] == "pass"})
    if behind:
        lines += [f"Families where transformers' own tp2 equals one process and ours does not pass tp2 "
                  f"({len(behind)}): {', '.join(behind)}.", ""]
    return lines + [
        "Each row: a tiny random-weight checkpoint of the family (transformers' `save_pretrained`: its real "
        "tensor names), a recipe with the layout, `python -m hyper_parallel.codegen generate` (its verify stage "
        "runs the bundle at the recipe's world size against one process on a shrunk probe: 2 AdamW steps, loss "
        f"rtol 1e-5, every gradient rtol 1e-4), then, if it generated, {TRAIN_STEPS} AdamW steps with the gen "
        "backend under torchrun from the checkpoint against single-process HF on the same batches (loss rtol "
        "1e-5, gradient norm rtol 1e-4, every step; after step 1 a row further off passes only within "
        "AdamW's own noise on the model: the deviation of one process trained again with fp32-rounding-sized "
        "noise on its gradients, and its reason says so).",
        "",
        "- **pass**: generated, verified, and trained equal to one process; \"pass (ep not applied)\": the "
        "layout ran without an axis it asks for, which derive recorded (nothing in the model could be placed on "
        "it: ep without experts the plan splits);",
        "- **refused**: generate stopped (exit code 2) with one of the project's own errors (resolve, derive, "
        "freeze, or verify's probe), naming what it cannot plan;",
        "- **FAIL**: anything else: a verify mismatch, a crash in a stage or in verify's ranks, a training "
        "mismatch or crash (e.g. the checkpoint does not load), a timeout;",
        "- **peer tp2**: the same checkpoint through transformers' `from_pretrained(dir, tp_plan=\"auto\")` at "
        f"tp 2 (world 2) against one process, {TRAIN_STEPS} AdamW steps in training mode, each step seeded alike "
        "(loss rtol 1e-5, gradient norm rtol "
        "1e-4, the same noise rule): pass / fail / unsupported (no `base_model_tp_plan`);",
        "- layouts: `tp2`; `tp2_sp_lp` = tp2 + sequence parallel + loss parallel; `cp2` (no "
        "`context_parallel` keys: the default algorithm, allgather_kv load-balanced, an attention block that "
        "cannot run it gathered as the plan's notes say); `dp2` (FSDP2); for MoE "
        "families `ep2` (dp2 + ep2, world 2) and `tp2_ep2` (tp2 + dp2 + ep2, world 4) — ep is borrowed from "
        "dp x cp; `n/a`: the layout does not apply;",
        "- `remote:<name>`: a decoder transformers does not ship, from the project's remote-code fixtures "
        "(`tests/data/remote_code/<name>`: `auto_map`, its own configuration and modeling files; module names "
        "and block structures of no transformers family); its config.json is the tiny config and its recipes "
        "set `model.trust_remote_code: true`.",
        "",
    ]


def docs_tables(families, layouts, cases, peer, moe, skipped) -> list[str]:
    """Family x layout, every non-pass reason, the peer's details, the skipped types."""
    lines = ["## Results", "", *result_table(families, layouts, cases, peer, moe), ""]
    problems = [c for c in cases if c.status != "pass"]
    if problems:
        lines += ["## Refusals and failures", "", "| family | layout | status | reason |", "|---|---|---|---|"]
        lines += [f"| {c.family} | {c.layout} | {c.status} | {md_cell(c.reason)} |" for c in problems]
        lines.append("")
    if peer:
        lines += ["## Peer (transformers tp_plan=\"auto\", tp2)", "", "| family | status | detail |", "|---|---|---|"]
        lines += [f"| {f} | {peer[f][0]} | {md_cell(peer[f][1])} |" for f in families if f in peer]
        lines.append("")
    if not skipped:  # --remote-only: transformers' families were not enumerated
        return lines
    lines += [f"## Skipped types ({len(skipped)})", "",
              "Types of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` that are not attention-based decoder-only text LMs "
              "(or cannot be built offline):", "", "| type | reason |", "|---|---|"]
    return lines + [f"| {f} | {md_cell(r)} |" for f, r in sorted(skipped.items())]


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- command line ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help=f"comma-separated model types and {REMOTE_PREFIX}<fixture> names "
                                            "(default: every kept family and every remote-code fixture)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all; ep layouts only for MoE)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at a time (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per generate / training run / peer case")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON here")
    parser.add_argument("--no-docs", action="store_true", help="don't write docs/families.md and docs/families.json")
    parser.add_argument("--keep", metavar="DIR", help="build the throwaway project here and keep it")
    parser.add_argument("--list", action="store_true",
                        help="print kept and skipped families and the remote-code fixtures, run nothing")
    parser.add_argument("--no-train", action="store_true", help="skip the gen-backend training after generate")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers tp_plan='auto' column")
    parser.add_argument("--journal", metavar="PATH",
                        help="append each finished case to PATH (JSON lines) and run only the cases it lacks")
    parser.add_argument("--redo", default="", metavar="STATUSES",
                        help="with --journal: also run cases (and peer rows) journaled with these statuses, "
                             "e.g. fail or fail,refused")
    parser.add_argument("--report", action="store_true",
                        help="with --journal: write the table and docs from the journal alone, running nothing "
                             "(cases it lacks are left out and named as not run)")
    parser.add_argument("--remote-only", action="store_true",
                        help=f"run only the remote-code fixtures ({REMOTE_PREFIX}<folder> of tests/data/remote_code)")
    return parser.parse_args()


def select(args, kept: list[str], skipped: dict[str, str], remote: list[str]) -> tuple[list[str], list[str]]:
    """The families and layouts asked for, checked against what exists: transformers'
    families first, then the remote-code fixtures (only those with --remote-only)."""
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        sys.exit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    layouts = [name for name in LAYOUTS if name in layouts]
    if not args.families:
        return (remote if args.remote_only else kept + remote), layouts
    families = sorted({name.strip() for name in args.families.split(",") if name.strip()},
                      key=lambda name: (is_remote(name), name))
    for family in families:
        if is_remote(family):
            if family not in remote:
                sys.exit(f"--families: {family} is not a remote-code fixture; fixtures: {', '.join(remote)}")
        elif args.remote_only:
            sys.exit(f"--families: {family} is not a remote-code fixture (--remote-only); fixtures: "
                     f"{', '.join(remote)}")
        elif family in skipped:
            sys.exit(f"--families: {family} is skipped: {skipped[family]}")
        elif family not in kept:
            sys.exit(f"--families: {family} is not a model type of the causal-LM mapping")
    return families, layouts


def partial_note(args, families: list[str], layouts: list[str], kept: list[str]) -> str:
    """Empty for the full sweep; otherwise what this run covered."""
    notes = []
    remote = remote_families()
    if args.remote_only:
        notes.append(f"Ran only remote-code fixtures (--remote-only), {len(families)} of {len(remote)}: "
                     f"{', '.join(families)}; transformers' families were not run.")
    elif families != kept + remote:
        hf = [family for family in families if not is_remote(family)]
        ours = [family for family in families if is_remote(family)]
        notes.append(f"Ran {len(hf)} of {len(kept)} kept families"
                     f"{': ' + ', '.join(hf) if hf and hf != kept else ''}, and {len(ours)} of {len(remote)} "
                     f"remote-code fixtures{': ' + ', '.join(ours) if ours and ours != remote else ''}.")
    if layouts != list(LAYOUTS):
        notes.append(f"Layouts run: {', '.join(layouts)} (of {', '.join(LAYOUTS)}).")
    if args.no_train:
        notes.append("Gen-backend training was not run (--no-train): pass means generated and verified.")
    if args.no_peer:
        notes.append("The peer column was not run (--no-peer).")
    return " ".join(notes)


def from_journal(journal: Journal, families: list[str], layouts: list[str], args):
    """--report: (journaled cases, journaled peer results, {family: is MoE}, the cases the
    journal lacks), nothing run."""
    moe = {family: is_moe(tiny_config(family)) for family in families}
    cases, not_run = [], []
    for family in families:
        for layout in layouts_for(family, moe[family], layouts):
            case = Case(family, layout)
            if (family, layout) in journal.cases:
                cases.append(journal.restore(case))
            else:
                not_run.append(case)
    peer = {} if args.no_peer else {family: (journal.peer[family]["status"], journal.peer[family]["reason"])
                                    for family in families if family in journal.peer}
    return cases, peer, moe, not_run


def not_run_note(not_run: list[Case]) -> str:
    """What a --report leaves out: the selected cases the journal does not have yet."""
    if not not_run:
        return ""
    families = sorted({case.family for case in not_run}, key=lambda name: (is_remote(name), name))
    return (f"{len(not_run)} selected case(s) of {len(families)} families have not run yet and are not in the "
            f"table: {', '.join(families)}.")


def commits_note(journal: Journal, cases: list[Case]) -> str:
    """Empty when every reported case ran at one commit; else which ran at which."""
    found = journal.commits(cases)
    if len(found) <= 1:
        return ""
    latest = max(found, key=lambda commit: len(found[commit]))
    others = "; ".join(f"at {commit}: {', '.join(rows)}" for commit, rows in found.items() if commit != latest)
    return f"Rows ran at {len(found)} commits (resumed from a journal): most at {latest}; {others}."


def command_line(args) -> str:
    """The command as it affects the results (no paths, no --jobs)."""
    parts = [REGENERATE]
    if args.remote_only:
        parts.append("--remote-only")
    if args.families:
        parts.append(f"--families {args.families}")
    if args.layouts != ",".join(LAYOUTS):
        parts.append(f"--layouts {args.layouts}")
    parts += [flag for flag, on in (("--no-train", args.no_train), ("--no-peer", args.no_peer),
                                    ("--journal PATH --report", args.report)) if on]
    return " ".join(parts)


def prepare(project: Path, families: list[str]) -> dict[str, bool]:
    """Checkpoints for every family (a complete one already in a kept project is reused:
    the weights are seeded, so it is the same); {family: is MoE}."""
    moe = {}
    for family in families:
        start = time.perf_counter()
        model_dir = project / "recipes" / family_dir(family) / "model"
        if not (model_dir / "config.json").is_file() or not list(model_dir.glob("*.safetensors")):
            save_checkpoint(family, model_dir)
        moe[family] = is_moe(tiny_config(family))
        progress(f"checkpoint {family}{' (MoE)' if moe[family] else ''}", time.perf_counter() - start)
    return moe


def run_cases(project: Path, cases: list[Case], args, journal: Journal, redo: set[str]) -> None:
    """Every case the journal lacks (or has with a status in ``redo``), ``--jobs`` at a time,
    each journaled as it finishes with a progress line; the others are restored from it."""
    todo = [case for case in cases if journal.wanted(case, redo)]
    for case in cases:
        if case not in todo:
            journal.restore(case)
    if len(todo) < len(cases):
        print(f"journal {journal.path}: {len(cases) - len(todo)} case(s) recorded, {len(todo)} to run",
              file=sys.stderr, flush=True)

    def one(case: Case) -> Case:
        run_case(project, case, timeout=args.timeout, train=not args.no_train)
        journal.record_case(case)
        detail = f": {case.reason}" if case.status != "pass" else ""
        progress(f"{case.family} {case.layout}: {case.status}{detail} (generate {case.generate_s:.1f}s, "
                 f"train {case.train_s:.1f}s)", case.generate_s + case.train_s)
        return case

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, todo))


def print_timings(cases: list[Case]) -> None:
    """Mean seconds per case by layout, to plan a full sweep."""
    for layout in LAYOUTS:
        rows = [c for c in cases if c.layout == layout]
        if rows:
            gen = sum(c.generate_s for c in rows) / len(rows)
            trained = [c.train_s for c in rows if c.train_s]
            train = sum(trained) / len(trained) if trained else 0.0
            print(f"timing {layout}: {len(rows)} case(s), generate {gen:.1f}s mean, train {train:.1f}s mean "
                  f"({len(trained)} trained)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # --remote-only does not enumerate transformers' families (it builds a meta model of each)
    kept, skipped = ([], {}) if args.remote_only else enumerate_families()
    remote = remote_families()
    if args.list:
        if not args.remote_only:
            print(f"kept ({len(kept)}): {' '.join(kept)}")
        print(f"remote-code fixtures ({len(remote)}): {' '.join(remote)}")
        if not args.remote_only:
            print(f"skipped ({len(skipped)}):")
            for family, reason in skipped.items():
                print(f"  {family}: {reason}")
        return
    families, layouts = select(args, kept, skipped, remote)
    journal = Journal(args.journal, trained=not args.no_train)
    redo = {status.strip() for status in args.redo.split(",") if status.strip()}
    if redo - {"pass", "refused", "fail", "unsupported"} or (redo and not args.journal):
        sys.exit(f"--redo {args.redo}: needs --journal and statuses of pass, refused, fail, unsupported")
    if args.report and (not args.journal or redo):
        sys.exit("--report: needs --journal (and no --redo): it writes the table from the journal alone")
    started = time.perf_counter()
    if args.report:
        cases, peer, moe, not_run = from_journal(journal, families, layouts, args)
    else:
        with tempfile.TemporaryDirectory(prefix="family_sweep_") as tmp:
            project = make_project(Path(args.keep).resolve() if args.keep else Path(tmp) / "project")
            moe = prepare(project, families)
            cases = [Case(family, layout) for family in families
                     for layout in layouts_for(family, moe[family], layouts)]
            run_cases(project, cases, args, journal, redo)
            peer = {} if args.no_peer else run_peer(project, families, args.timeout, journal, redo)
        not_run = []
    note = " ".join(filter(None, [partial_note(args, families, layouts, kept), not_run_note(not_run)]))
    summary = summary_line(cases, peer, None if args.remote_only else len(kept), len(skipped),
                           "; partial run" if note else "", remote=len(remote))
    print_report(families, layouts, cases, peer, moe, summary)
    print_timings(cases)
    print(f"total {time.perf_counter() - started:.0f}s")
    report = dict(families=families, layouts=layouts, cases=cases, peer=peer, moe=moe, skipped=skipped,
                  summary=summary, command=command_line(args), partial=note, commits=commits_note(journal, cases))
    if args.json:
        write_docs(None, Path(args.json), **report)
    if not args.no_docs:
        write_docs(DOCS_MD, DOCS_JSON, **report)


if __name__ == "__main__":
    main()
