"""doit tasks for hyper-parallel codegen: `doit generate [config=recipes/X.yaml]`, `doit check`,
`doit clean`, `doit list`. One task per row of the stage table
(hyper_parallel.codegen.stage_table) plus generate and check; the creators live in
hyper_parallel.codegen.doit_tasks."""

from hyper_parallel.codegen import doit_tasks as tasks

DOIT_CONFIG = tasks.DOIT_CONFIG

globals().update(tasks.task_creators())
