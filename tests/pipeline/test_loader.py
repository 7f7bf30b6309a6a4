"""The loader imports a bundle as a synthetic package: one stable module name per
bundle directory, sys.path untouched, failed imports not cached (DESIGN §6)."""

import sys
from pathlib import Path

import pytest

from hyper_parallel.runtime.loader import (
    PACKAGE_PREFIX,
    BundleImportError,
    bundle_package_name,
    load_generated_module,
)
from tests.pipeline.pipeline_helpers import install_fake_bundle


@pytest.fixture(autouse=True)
def forget_test_bundles(tmp_path):
    """Drop what these tests imported, so sys.modules does not grow across tests."""
    yield
    for name in [n for n in sys.modules if n.startswith(PACKAGE_PREFIX + "._")]:
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if module_file.startswith(str(tmp_path)):
            del sys.modules[name]


def _bundle_modules(bundle: Path) -> list[str]:
    package = bundle_package_name(bundle, signature="")  # the folder's prefix, any signature
    return sorted(n for n in sys.modules if n.startswith(package))


def test_same_directory_gives_the_same_module(tmp_path, monkeypatch):
    bundle = install_fake_bundle(tmp_path / "recipes" / "generated", "VALUE = 1\n")
    first = load_generated_module(bundle)
    monkeypatch.chdir(tmp_path)
    again = load_generated_module(Path("recipes/other/../generated"))  # another spelling, same dir

    assert again is first
    assert first.VALUE == 1
    assert first.__name__ == f"{bundle_package_name(bundle)}.modeling_fake"
    assert bundle_package_name("recipes/generated") == bundle_package_name(bundle)
    assert first.__name__.replace(".", "").replace("_", "").isalnum()


def test_two_directories_get_two_modules(tmp_path):
    one = install_fake_bundle(tmp_path / "a" / "generated", "VALUE = 'a'\n")
    two = install_fake_bundle(tmp_path / "b" / "generated", "VALUE = 'b'\n")

    first, second = load_generated_module(one), load_generated_module(two)

    assert bundle_package_name(one) != bundle_package_name(two)
    assert first.__name__ != second.__name__
    assert (first.VALUE, second.VALUE) == ("a", "b")
    assert Path(first.__file__) == one / "modeling_fake.py"


def test_import_leaves_sys_path_alone(tmp_path):
    bundle = install_fake_bundle(tmp_path / "generated", "import sys\nPATH_AT_IMPORT = list(sys.path)\n")
    before = list(sys.path)

    module = load_generated_module(bundle)

    assert sys.path == before
    assert module.PATH_AT_IMPORT == before  # not even temporarily during the import
    assert not any(str(tmp_path) in entry for entry in sys.path)


@pytest.mark.parametrize("broken, error", [
    ("def broken(:\n", "SyntaxError"),
    ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
])
def test_failed_import_is_not_cached(tmp_path, broken, error):
    bundle = install_fake_bundle(tmp_path / "generated", broken)

    with pytest.raises(BundleImportError) as info:
        load_generated_module(bundle)
    message = str(info.value)
    assert str(bundle / "modeling_fake.py") in message and error in message, message
    assert _bundle_modules(bundle) == []

    install_fake_bundle(bundle, "VALUE = 'fixed'\n")  # regenerated (an edited file would be refused)
    assert load_generated_module(bundle).VALUE == "fixed"
    assert _bundle_modules(bundle) == sorted([bundle_package_name(bundle),
                                              f"{bundle_package_name(bundle)}.modeling_fake"])


def test_missing_bundle_names_the_meta_file(tmp_path):
    with pytest.raises(ValueError, match="codegen_meta.json missing"):
        load_generated_module(tmp_path / "generated")
    assert _bundle_modules(tmp_path / "generated") == []


def test_a_reinstalled_bundle_with_a_new_signature_is_imported_afresh(tmp_path):
    bundle = install_fake_bundle(tmp_path / "generated", "VALUE = 1\n", signature="a" * 64)
    assert load_generated_module(bundle).VALUE == 1
    install_fake_bundle(bundle, "VALUE = 2\n", signature="b" * 64)
    assert load_generated_module(bundle).VALUE == 2


def test_a_planted_bytecode_cache_is_never_executed(tmp_path):
    """A __pycache__ entry that claims to be the modeling file (an unchecked-hash .pyc,
    which CPython's own loader runs without looking at the source) is ignored: the loader
    compiles the listed file's verified bytes."""
    import importlib.util
    import py_compile

    bundle = install_fake_bundle(tmp_path / "generated", "VALUE = 'genuine'\n")
    evil = tmp_path / "evil.py"
    evil.write_text("VALUE = 'planted'\n")
    cache = Path(importlib.util.cache_from_source(str(bundle / "modeling_fake.py")))
    py_compile.compile(str(evil), cfile=str(cache), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert load_generated_module(bundle).VALUE == "genuine"


def test_an_edited_file_is_not_imported_even_unchecked(tmp_path):
    bundle = install_fake_bundle(tmp_path / "generated", "VALUE = 1\n")
    (bundle / "modeling_fake.py").write_text("VALUE = 2\n")
    with pytest.raises(BundleImportError, match=r"modeling_fake.py: sha256 \w+ differs from the bundle's"):
        load_generated_module(bundle)


def test_only_the_bundle_files_are_its_submodules(tmp_path):
    """A module dropped into the bundle folder is not importable as part of the bundle."""
    bundle = install_fake_bundle(tmp_path / "generated", "from .dropped import VALUE\n")
    (bundle / "dropped.py").write_text("VALUE = 'not listed'\n")
    with pytest.raises(BundleImportError, match="dropped.py is not a file of the bundle"):
        load_generated_module(bundle)
