"""``python -m hyper_parallel.codegen``: generate, check or clean a recipe's bundle.

The same stages as ``doit generate`` / ``doit check`` / ``doit clean``.
"""

import argparse
import logging
import os
import sys
import traceback

from hyper_parallel.codegen.manager import clean_recipe, ensure_bundle, run_pipeline
from hyper_parallel.codegen.spec.project import RECIPES_DIR, project_codegen_spec, project_recipes
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.codegen.stage_table import STAGES, WORKSPACE_DIR
from hyper_parallel.config import load_training_config
from hyper_parallel.config.launch import check_launch_world_size
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.console_log import configure_console_logging
from hyper_parallel.errors import HyperParallelError

EPILOG = """examples:
  python -m hyper_parallel.codegen generate --config recipes/qwen3_moe.yaml
  python -m hyper_parallel.codegen --verbose check --config recipes/qwen3_moe.yaml
  python -m hyper_parallel.codegen check --all            # CI's freshness gate
  python -m hyper_parallel.codegen check --all --fix      # regenerate what is stale
  python -m hyper_parallel.codegen clean --config recipes/qwen3_moe.yaml

generate runs the stale stages (resolve, derive, freeze, emit, diff, verify, install,
preflight) and installs the bundle into <recipe folder>/generated/ only after verify ran
it at the recipe's world size and matched one process (loss and every gradient). check
is the freshness gate: it fails, printing the unified diff of each stale file, when a
committed bundle differs from what generate would write now (--fix regenerates it);
a current bundle is then verified again and preflighted with torchrun. clean removes
the bundle and the recipe's workspace under ./{workspace}/. Under torchrun, rank 0
generates and the other ranks wait for it; every rank then runs the integrity preflight.
Exit codes: 0 ok, 1 a check failed (stale, verify or preflight), 2 bad input.""".format(workspace=WORKSPACE_DIR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Generate a parallelized modeling file from a training recipe.")
    parser.add_argument("--verbose", action="store_true", help="print per-stage progress and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("generate", "build the bundle (only stale stages run)"),
                       ("check", "fail with a diff when a committed bundle is stale; verify and preflight it"),
                       ("clean", "remove the installed bundle and the workspace")):
        cmd = sub.add_parser(name, help=text, description=text)
        if name == "check":
            which = cmd.add_mutually_exclusive_group(required=True)
            which.add_argument("--config", help="the training recipe (YAML)")
            which.add_argument("--all", action="store_true",
                               help=f"every recipe under ./{RECIPES_DIR}/ (the committed bundles)")
            cmd.add_argument("--fix", action="store_true", help="regenerate a stale bundle instead of failing")
        else:
            cmd.add_argument("--config", required=True, help="the training recipe (YAML)")
        cmd.add_argument("--workspace", default=None,
                         help=f"pipeline workspace root (default: ./{WORKSPACE_DIR})")
        if name == "generate":
            cmd.add_argument("--force", action="store_true", help="rerun every stage")
            cmd.add_argument("--skip-preflight", action="store_true", help="stop after install")
            cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                             help="override a recipe key for this generate (repeatable), e.g. --set "
                                  "accelerator.tp_size=4; checked as the recipe's own keys are")
    return parser


EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress with --verbose; clean always says what it removed; warnings always.
    shown = args.verbose or args.command == "clean"
    configure_console_logging(logging.INFO if shown else logging.WARNING)
    recipes = project_recipes() if getattr(args, "all", False) else [args.config]
    if not recipes:
        print(f"error: no recipe under ./{RECIPES_DIR}/ (check --all looks for *.yaml there)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return max(_run_one(args, recipe) for recipe in recipes)


def _run_one(args: argparse.Namespace, recipe: str) -> int:
    """The command on one recipe; its failure is reported and returned, never raised."""
    try:
        return _dispatch(args, recipe)
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {_naming_recipe(str(exc), recipe)}", file=sys.stderr)
        return EXIT_BAD_INPUT if is_bad_input(exc) else 1


def is_bad_input(exc: BaseException) -> bool:
    """The recipe, the model folder or the bundle folder is at fault (exit code 2), not a
    check that ran and failed or a fault of ours (exit code 1). Our input errors are the
    project's ValueError kinds (RecipeError, SourceError, DeriveError, ...) and BundleError."""
    from hyper_parallel.codegen.bundle_folder import BundleError

    return isinstance(exc, HyperParallelError) and isinstance(exc, (ValueError, BundleError))


def _naming_recipe(message: str, config: str) -> str:
    """Prefix the recipe path unless the message already names it (errors from the
    planner or the model source talk about the model, not the file that asked for it)."""
    return message if os.path.basename(config) in message else f"{config}: {message}"


def _dispatch(args: argparse.Namespace, recipe: str) -> int:
    config = load_training_config(recipe, getattr(args, "set", []))  # the recipe's one parse in this process
    spec = project_codegen_spec(config, workspace_root=args.workspace)  # and its one projection
    if args.command == "clean":
        clean_recipe(spec)
        return 0
    if "WORLD_SIZE" in os.environ:
        return _under_torchrun(args, recipe, config, spec)
    if args.command == "generate":
        stages = STAGES[:-1] if args.skip_preflight else STAGES
        ran = run_pipeline(spec, stages, force=args.force)
        print(f"{spec.bundle_dir}: {'stages run: ' + ', '.join(ran) if ran else 'up to date'}")
        return 0
    return check_bundle(spec, fix=args.fix)


def check_bundle(spec: CodegenSpec, *, fix: bool) -> int:
    """The freshness gate for one recipe, then (for a current bundle) verify and preflight."""
    from hyper_parallel.codegen.check.freshness import stale_report
    from hyper_parallel.codegen.stages import check_installed

    report = stale_report(spec)
    fixed = False
    if report and fix:
        print(f"{spec.bundle_dir}: stale; regenerating it (--fix)")
        run_pipeline(spec, STAGES)  # generate verifies and preflights what it installs
        report = stale_report(spec)
        fixed = not report
    if report:
        print(report, file=sys.stderr)
        return 1
    if not fixed:
        check_installed(spec)
    print(f"{spec.bundle_dir}: {'regenerated; ' if fixed else ''}check passed (current, verified, preflight ok)")
    return 0


def _under_torchrun(args: argparse.Namespace, recipe: str, config: TrainerConfig, spec: CodegenSpec) -> int:
    """One rank: rank 0 generates (or reuses) the bundle, the others wait for it; then
    every rank checks the installed bundle's integrity."""
    from hyper_parallel.codegen.check.drift import fix_command
    from hyper_parallel.runtime.integrity import preflight_integrity_check
    from hyper_parallel.codegen.spec.project import signature_from_spec

    check_launch_world_size(config)
    if args.command == "generate":
        ensure_bundle(spec)
    report = preflight_integrity_check(spec.bundle_dir, expected_signature=signature_from_spec(spec),
                                       fix=fix_command(spec))
    print(f"rank {os.environ.get('RANK', '0')}: {spec.bundle_dir} ok (digest {report['digest'][:12]})")
    return 0
