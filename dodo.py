"""doit tasks for hyper-parallel codegen: `doit generate [config=recipes/X.yaml]`, `doit check`,
`doit clean`, `doit list`. The definitions live in hyper_parallel.codegen.doit_tasks."""

from hyper_parallel.codegen import doit_tasks as tasks

DOIT_CONFIG = tasks.DOIT_CONFIG


def task_resolve():
    """find the HF modeling source, its sha256 and the transformers version"""
    yield from tasks.stage_tasks("resolve")


def task_derive():
    """plan every module on a meta-device model over an offline mesh"""
    yield from tasks.stage_tasks("derive")


def task_freeze():
    """validate, normalize and pattern-compress the plan"""
    yield from tasks.stage_tasks("freeze")


def task_emit():
    """write the generated modeling file and __init__.py (staged)"""
    yield from tasks.stage_tasks("emit")


def task_diff():
    """diff the generated file against the HF modeling source (staged)"""
    yield from tasks.stage_tasks("diff")


def task_verify():
    """run the staged bundle at the recipe's world size on a shrunk probe; compare with one process"""
    yield from tasks.stage_tasks("verify")


def task_install():
    """swap the verified staged bundle into <recipe dir>/generated/ atomically"""
    yield from tasks.stage_tasks("install")


def task_preflight():
    """torchrun across the recipe's world size: apply the plan, check shards and digests"""
    yield from tasks.stage_tasks("preflight")


def task_generate():
    """build every stale stage of the recipe(s) through the torchrun preflight"""
    yield from tasks.generate_tasks()


def task_check():
    """installed bundle matches the recipe; verify it against one process; torchrun preflight"""
    yield from tasks.check_tasks()
