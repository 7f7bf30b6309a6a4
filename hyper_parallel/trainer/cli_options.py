"""Command-line options every trainer entry point shares (train, launch, dry-run)."""

import argparse


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a recipe key for this run, typed and checked by the
    recipe's schema as if the YAML said it (``config.loading.apply_overrides``)."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key for this run (repeatable), e.g. --set training.steps=3 "
                             "--set training.checkpoint.dir=null; checked as the recipe's own keys are")


def set_arguments(overrides: list[str]) -> list[str]:
    """``overrides`` as the arguments that hand them to another entry point (a rank)."""
    return [f"--set={item}" for item in overrides]
