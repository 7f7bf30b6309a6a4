"""``python -m hyper_parallel.codegen``: generate, check or clean a recipe's bundle.

The same stages as ``doit generate`` / ``doit check`` / ``doit clean`` (DESIGN §1).
"""

import argparse
import logging
import os
import sys
import traceback

from hyper_parallel.codegen.manager import clean_recipe, ensure_bundle, run_pipeline
from hyper_parallel.codegen.spec.project import project_codegen_spec
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
  python -m hyper_parallel.codegen clean --config recipes/qwen3_moe.yaml

generate runs the stale stages (resolve, derive, freeze, emit, diff, verify, install,
preflight) and installs the bundle into <recipe folder>/generated/ only after verify ran
it at the recipe's world size and matched one process (loss and every gradient). check
compares the installed bundle with the recipe, verifies it again and runs the torchrun
preflight. clean removes the bundle and
the recipe's workspace under ./{workspace}/. Under torchrun, rank 0 generates and the
other ranks wait for it; every rank then runs the integrity preflight.""".format(workspace=WORKSPACE_DIR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.codegen", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Generate a parallelized modeling file from a training recipe.")
    parser.add_argument("--verbose", action="store_true", help="print per-stage progress and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("generate", "build the bundle (only stale stages run)"),
                       ("check", "check the installed bundle, verify it against one process, run the preflight"),
                       ("clean", "remove the installed bundle and the workspace")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", required=True, help="the training recipe (YAML)")
        cmd.add_argument("--workspace", default=None,
                         help=f"pipeline workspace root (default: ./{WORKSPACE_DIR})")
        if name == "generate":
            cmd.add_argument("--force", action="store_true", help="rerun every stage")
            cmd.add_argument("--skip-preflight", action="store_true", help="stop after install")
    return parser


EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress with --verbose; clean always says what it removed; warnings always.
    shown = args.verbose or args.command == "clean"
    configure_console_logging(logging.INFO if shown else logging.WARNING)
    try:
        return _dispatch(args)
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {_naming_recipe(str(exc), args.config)}", file=sys.stderr)
        return EXIT_BAD_INPUT if is_bad_input(exc) else 1


def is_bad_input(exc: BaseException) -> bool:
    """The recipe, the model folder or the bundle folder is at fault (exit code 2), not a
    check that ran and failed or a fault of ours (exit code 1). Our input errors are the
    project's ValueError kinds (RecipeError, SourceError, DeriveError, ...) and ArtifactError."""
    from hyper_parallel.codegen.artifact import ArtifactError

    return isinstance(exc, HyperParallelError) and isinstance(exc, (ValueError, ArtifactError))


def _naming_recipe(message: str, config: str) -> str:
    """Prefix the recipe path unless the message already names it (errors from the
    planner or the model source talk about the model, not the file that asked for it)."""
    return message if os.path.basename(config) in message else f"{config}: {message}"


def _dispatch(args: argparse.Namespace) -> int:
    config = load_training_config(args.config)  # the recipe's one parse in this process
    spec = project_codegen_spec(config, workspace_root=args.workspace)  # and its one projection
    if args.command == "clean":
        clean_recipe(spec)
        return 0
    if "WORLD_SIZE" in os.environ:
        return _under_torchrun(args, config, spec)
    if args.command == "generate":
        stages = STAGES[:-1] if args.skip_preflight else STAGES
        ran = run_pipeline(spec, stages, force=args.force)
        print(f"{spec.artifact_dir}: {'stages run: ' + ', '.join(ran) if ran else 'up to date'}")
        return 0
    from hyper_parallel.codegen.stages import check_installed, verify_installed

    problems = check_installed(spec)
    if problems:
        print("\n".join(problems) + f"\n  fix: doit generate config={args.config}", file=sys.stderr)
        return 1
    verify_installed(spec)
    run_pipeline(spec, ["preflight"], force=True)
    print(f"{spec.artifact_dir}: check passed")
    return 0


def _under_torchrun(args: argparse.Namespace, config: TrainerConfig, spec: CodegenSpec) -> int:
    """One rank: rank 0 generates (or reuses) the bundle, the others wait for it; then
    every rank checks the installed bundle's integrity."""
    from hyper_parallel.codegen.check.preflight import preflight_integrity_check
    from hyper_parallel.codegen.spec.project import signature_from_spec

    check_launch_world_size(config)
    if args.command == "generate":
        ensure_bundle(spec)
    report = preflight_integrity_check(spec.artifact_dir, expected_signature=signature_from_spec(spec),
                                       fix=f"doit generate config={args.config}")
    print(f"rank {os.environ.get('RANK', '0')}: {spec.artifact_dir} ok (digest {report['digest'][:12]})")
    return 0
