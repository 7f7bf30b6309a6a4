"""A `doit` entry point that fails (exit 99) when the run imported torch or transformers:
the proof that `dodo.py` and every up-to-date check stay import-light. Tests and benches
run it as ``python -c NO_TORCH_BOOT <doit args>`` in a project folder."""

TORCH_IMPORTED_RC = 99

NO_TORCH_BOOT = f"""
import runpy
import sys
from doit.cmd_base import ModuleTaskLoader
from doit.doit_cmd import DoitMain
dodo = runpy.run_path('dodo.py')
rc = DoitMain(ModuleTaskLoader(dodo)).run(sys.argv[1:])
heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)
if heavy:
    print('FORBIDDEN IMPORTS during the doit run: ' + ', '.join(heavy))
    sys.exit({TORCH_IMPORTED_RC})
sys.exit(rc)
"""
