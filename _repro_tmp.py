import shutil, sys, time
from pathlib import Path
from tests.pipeline.test_concurrent_generate import _start_together, DOIT_GENERATE
from tests.project_fixtures import make_project, TINY_RECIPE
from hyper_parallel.codegen.check.preflight import preflight_integrity_check
from hyper_parallel.codegen.manager import load_spec
from hyper_parallel.codegen.spec.project import signature_from_spec
for i in range(int(sys.argv[1])):
    d = Path(f'/tmp/exp/rep{i}'); shutil.rmtree(d, ignore_errors=True)
    p = make_project(d)
    t = time.time()
    res = _start_together(DOIT_GENERATE, p)
    print(i, time.time() - t, [r.returncode for r in res], flush=True)
    for r in res:
        if r.returncode: print(r.stdout[-3000:], r.stderr[-3000:])
    spec = load_spec(p / TINY_RECIPE, p / "generated")
    try:
        print(preflight_integrity_check(spec.artifact_dir, expected_signature=signature_from_spec(spec)))
    except Exception as e:
        print("FAIL", type(e).__name__, e)
        for r in res: print(r.stdout[-4000:]); print("----")
