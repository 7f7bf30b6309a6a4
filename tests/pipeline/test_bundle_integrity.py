"""A changed installed bundle is caught before it is imported, and an install killed
at any instant leaves a complete bundle (issue: bundle integrity, DESIGN §4, §7)."""

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyper_parallel.codegen.bundle_folder import remove_stale_staging_dirs, write_bundle_atomic
from hyper_parallel.codegen.hash import sha256_bytes, sha256_file
from hyper_parallel.runtime.integrity import PreflightError, bundle_file_problems, preflight_integrity_check
from hyper_parallel.runtime.loader import bundle_package_name
from hyper_parallel.runtime.meta import META_FILE, load_codegen_meta
from tests.pipeline.pipeline_helpers import BUNDLE, ENV, MODELING_FILE, copy_project, generated_tiny_project
from tests.project_fixtures import REPO, TINY_RECIPE, doit

KILL_TRIALS = 24


@pytest.fixture
def project(tmp_path_factory, tmp_path):
    """A private copy of the generated tiny project, its bundle verified intact."""
    project = copy_project(generated_tiny_project(tmp_path_factory), tmp_path / "project")
    assert bundle_file_problems(project / BUNDLE, load_codegen_meta(project / BUNDLE)) == []
    return project


def _doit_check(project: Path) -> str:
    proc = doit(project, "check", f"config={TINY_RECIPE}", env=ENV)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _imported_from(bundle: Path) -> list[str]:
    package = bundle_package_name(bundle, signature="")  # the folder's prefix, any signature
    return [name for name in sys.modules if name.startswith(package)]


def _preflight_fails(project: Path, signature: str) -> str:
    """What a rank expecting ``signature`` reports for the bundle; it must not import it."""
    bundle = project / BUNDLE
    with pytest.raises(PreflightError) as info:
        preflight_integrity_check(bundle, expected_signature=signature)
    assert _imported_from(bundle) == []  # rejected before import: nothing of it was executed
    return str(info.value)


# --- tampering ------------------------------------------------------------------------------

def test_changed_byte_in_modeling_file_fails_check(project):
    modeling = project / BUNDLE / MODELING_FILE
    meta = load_codegen_meta(project / BUNDLE)
    expected = meta["outputs"][MODELING_FILE]
    data = bytearray(modeling.read_bytes())
    data[len(data) // 2] ^= 0x01
    modeling.write_bytes(bytes(data))
    actual = sha256_file(modeling)

    for message in (_doit_check(project), _preflight_fails(project, meta["signature"])):
        assert str(modeling) in message and "sha256 mismatch" in message, message
        assert expected in message and actual in message, message
        assert "fix: doit generate" in message


def _edit_signature(text: str) -> str:
    meta = json.loads(text)
    meta["signature"] = "f" * 64
    return json.dumps(meta, indent=2)


def _remove_outputs(text: str) -> str:
    meta = json.loads(text)
    del meta["outputs"]
    return json.dumps(meta, indent=2)


META_TAMPERING = {
    "edited_signature": (_edit_signature, ["signature mismatch", "f" * 64]),
    "removed_required_field": (_remove_outputs, ["required field(s) missing: outputs"]),
    "truncated": (lambda text: text[: len(text) // 2], ["unreadable"]),
}


@pytest.mark.parametrize("case", sorted(META_TAMPERING))
def test_tampered_meta_is_detected_and_never_imported(project, case):
    edit, fragments = META_TAMPERING[case]
    meta_path = project / BUNDLE / META_FILE
    signature = load_codegen_meta(project / BUNDLE)["signature"]  # what every rank expects
    meta_path.write_text(edit(meta_path.read_text()))

    for message in (_preflight_fails(project, signature), _doit_check(project)):
        assert str(meta_path) in message, message
        for fragment in fragments:
            assert fragment in message, message
    if case == "edited_signature":  # both sides of the mismatch are named
        assert signature in _preflight_fails(project, signature)
        assert re.search(f"now gives [0-9a-f]{{64}}, the bundle was built for {'f' * 64}", _doit_check(project))


# --- SIGKILL during install -----------------------------------------------------------------

INSTALL_LOOP = """
import json, sys
from pathlib import Path
from hyper_parallel.codegen.bundle_folder import write_bundle_atomic

target, *sources = sys.argv[1:]
bundles = []
for source in map(Path, sources):
    files = {p.name: p.read_bytes() for p in sorted(source.iterdir()) if p.name != "codegen_meta.json"}
    bundles.append((files, (source / "codegen_meta.json").read_bytes()))
print("ready", flush=True)
i = 0
while True:
    write_bundle_atomic(target, *bundles[i % 2])
    i += 1
"""


def _variant_of(bundle: Path, dest: Path) -> Path:
    """A complete, self-consistent second bundle: a changed comment, matching meta."""
    dest.mkdir()
    meta = load_codegen_meta(bundle)
    for name in meta["outputs"]:
        data = (bundle / name).read_bytes()
        if name == MODELING_FILE:
            data += b"\n# variant: same code, different bytes\n"
        (dest / name).write_bytes(data)
        meta["outputs"][name] = sha256_bytes(data)
    (dest / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def _kill_during_installs(target: Path, first: Path, second: Path, rng: random.Random) -> int:
    """Start a child installing ``second``, ``first``, ... in a loop; SIGKILL it at a
    random moment. Returns its pid."""
    child = subprocess.Popen([sys.executable, "-c", INSTALL_LOOP, str(target), str(second), str(first)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.12))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return child.pid


def _staging_dirs(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".hp-bundle-{target.name}-*"))


def test_install_killed_at_any_instant_leaves_a_complete_bundle(project, tmp_path):
    bundle = project / BUNDLE
    first = copy_project(bundle, tmp_path / "first")
    second = _variant_of(bundle, tmp_path / "second")
    modeling_hashes = {sha256_file(first / MODELING_FILE): "first", sha256_file(second / MODELING_FILE): "second"}
    rng = random.Random(1234)
    seen, killed_mid_install = [], 0
    for trial in range(KILL_TRIALS):
        pid = _kill_during_installs(bundle, first, second, rng)
        meta = load_codegen_meta(bundle)
        assert bundle_file_problems(bundle, meta) == [], f"trial {trial}"
        assert sorted(p.name for p in bundle.iterdir()) == sorted([META_FILE, *meta["outputs"]])
        seen.append(modeling_hashes[meta["outputs"][MODELING_FILE]])
        killed_mid_install += any(f"-{pid}-" in p.name for p in _staging_dirs(bundle))
    # The kills hit at different moments, most inside an install (its staging dir is left).
    assert set(seen) == {"first", "second"}, seen
    assert killed_mid_install >= KILL_TRIALS // 4, killed_mid_install
    write_bundle_atomic(bundle, {n: (first / n).read_bytes() for n in load_codegen_meta(first)["outputs"]},
                        (first / META_FILE).read_bytes())
    assert _staging_dirs(bundle) == []  # the next install removed what the killed ones left
    report = preflight_integrity_check(bundle, expected_signature=load_codegen_meta(first)["signature"])
    assert report["plan_entries"] > 0


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_install_removes_only_our_dead_staging_dirs(tmp_path):
    target = tmp_path / "generated"
    write_bundle_atomic(target, {"a.py": b"A = 1\n"}, b"{}\n")
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [tmp_path / f".hp-bundle-generated-{dead}-0badc0de"]
        kept = [tmp_path / f".hp-bundle-generated-{sleeper.pid}-1234abcd",  # its writer is alive
                tmp_path / f".hp-bundle-other-{dead}-0badc0de",  # another bundle's
                tmp_path / f".hp-bundlegenerated-{dead}-0badc0de",  # not our prefix
                tmp_path / f"hp-bundle-generated-{dead}-0badc0de",
                tmp_path / ".hp-bundle-generated-notapid-0badc0de"]
        for path in stale + kept:
            path.mkdir()
            (path / "a.py").write_text("half written")
        not_a_dir = tmp_path / f".hp-bundle-generated-{dead}-f11ef11e"
        not_a_dir.write_text("a file")

        write_bundle_atomic(target, {"a.py": b"A = 2\n"}, b"{}\n")

        assert [p for p in stale if p.exists()] == []
        assert [p for p in kept + [not_a_dir] if not p.exists()] == []
        assert (target / "a.py").read_bytes() == b"A = 2\n"
        assert remove_stale_staging_dirs(target) == []  # nothing of ours is left
    finally:
        sleeper.kill()
        sleeper.wait()
