"""Packaging: what setup.py builds when an extension does not compile, how kvwire loads
what was built (and what README says the CRC reports of it), what the sdist carries, and
that the optional extras stay optional (``mypy`` without redis-py, ``from
kvwire.consistency import *`` without it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import kvwire
from kvwire._extensions import load_extension

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXTENSIONS = {
    "kvwire.codec._hostcodec": "kvwire/codec/_hostcodec.c",
    "kvwire.wire._crc32c": "kvwire/wire/_crc32c.c",
    "kvwire.aio._sendq": "kvwire/aio/_sendq.c",
}
posix_only = pytest.mark.skipif(os.name == "nt", reason="setup.py builds no extension on Windows")


def _environ(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "KVWIRE_NO_EXTENSIONS"}
    environ.update(extra)
    return environ


def _python(code: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    environ = _environ(**env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=120, check=False)


# ---------------------------------------------------------------------------------------
# Loading: an extension that cannot be loaded is one that was not built.


def test_an_extension_that_fails_to_load_is_not_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ImportError (not built, built for another Python) and AttributeError (what
    ``PyCapsule_Import`` raises for a module that is absent) mean "use the pure-Python
    code"; any other error is a bug and is raised."""
    (tmp_path / "kvw_ext_attr.py").write_text("import os\nos.no_such_attribute\n")
    (tmp_path / "kvw_ext_import.py").write_text("raise ImportError('undefined symbol: crc_update')\n")
    (tmp_path / "kvw_ext_bug.py").write_text("raise RuntimeError('a bug in the module')\n")
    (tmp_path / "kvw_ext_ok.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVWIRE_NO_EXTENSIONS", raising=False)
    for name in ("kvw_ext_attr", "kvw_ext_import", "kvw_ext_bug", "kvw_ext_ok"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert load_extension("kvw_ext_attr") is None
    assert load_extension("kvw_ext_import") is None
    assert load_extension("kvw_ext_missing_entirely") is None
    with pytest.raises(RuntimeError, match="a bug"):
        load_extension("kvw_ext_bug")
    module = load_extension("kvw_ext_ok")
    assert module is not None and module.VALUE == 1
    monkeypatch.setenv("KVWIRE_NO_EXTENSIONS", "1")
    assert load_extension("kvw_ext_ok") is None


def test_import_kvwire_where_the_crc_extension_is_missing() -> None:
    """The send queue finds the CRC loop of ``kvwire.wire._crc32c`` through a capsule:
    where that one is missing (it failed to build, the others built), the capsule lookup
    raised AttributeError out of ``import kvwire``.  kvwire now runs without both."""
    out = _python(
        "import sys\n"
        "sys.modules['kvwire.wire._crc32c'] = None  # as if it were not built\n"
        "import kvwire\n"
        "from kvwire.aio import _stream\n"
        "from kvwire.wire import crc\n"
        "assert crc.implementation() == 'crc32c package', crc.implementation()\n"
        "assert _stream._sendq is None\n"
        "found = kvwire.extensions()\n"
        "assert found['crc32c'] is None and found['send_queue'] is None, found\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


def test_readme_says_what_crc_implementation_returns() -> None:
    """``kvwire.wire.crc.implementation()`` is words (``compiled <loop>`` or ``crc32c
    package``), the loop alone being what ``kvwire.extensions()["crc32c"]`` gives."""
    from kvwire.wire import crc

    loop = kvwire.extensions()["crc32c"]
    assert crc.implementation() == ("crc32c package" if loop is None else f"compiled {loop}")
    text = " ".join(README.read_text().split())
    assert "`kvwire.wire.crc.implementation()` says which, in words: `'compiled avx512-vpclmulqdq'`" in text
    assert "`'crc32c package'`" in text


# ---------------------------------------------------------------------------------------
# Building with a compiler that fails on one source (a fake one: no real compile).

FAKE_CC = """\
#!{python}
import os, sys
args = sys.argv[1:]
fail = [name for name in os.environ["FAKE_CC_FAIL"].split(",") if name]
failing = [a for a in args if os.path.basename(a) in fail]
if failing:
    sys.exit("cc: error: cannot compile " + failing[0])
out = args[args.index("-o") + 1]
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out, "wb") as f:
    f.write(b"fake")
"""


def _project(tmp_path: Path) -> Path:
    """setup.py and pyproject.toml of this checkout over empty C sources."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for package in ("kvwire", "kvwire/codec", "kvwire/wire", "kvwire/aio"):
        (src / package).mkdir(exist_ok=True)
        (src / package / "__init__.py").write_text("")
    for source in EXTENSIONS.values():
        (src / source).write_text("")
    return src


def _build(tmp_path: Path, fail: str, *args: str) -> tuple[Path, str]:
    src = _project(tmp_path)
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_CC.format(python=sys.executable))
    cc.chmod(0o755)
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "temp"), *args],
        cwd=src, env=_environ(CC=str(cc), LDSHARED=f"{cc} -shared", FAKE_CC_FAIL=fail),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return src, out.stderr


def _built(where: Path) -> set[str]:
    return {
        name for name, source in EXTENSIONS.items()
        if list((where / source).parent.glob(Path(source).stem + "*.so"))
    }


@posix_only
def test_the_send_queue_is_not_built_without_the_crc_extension(tmp_path: Path) -> None:
    """_sendq loads _crc32c's CRC loop at import: with _crc32c failing to compile it was
    built anyway (and broke ``import kvwire``); now it is left out, with a warning."""
    _, stderr = _build(tmp_path, "_crc32c.c", "--build-lib", str(tmp_path / "lib"))
    assert _built(tmp_path / "lib") == {"kvwire.codec._hostcodec"}
    assert "WARNING: could not build kvwire.wire._crc32c" in stderr
    assert "WARNING: could not build kvwire.aio._sendq (it needs kvwire.wire._crc32c)" in stderr


@posix_only
def test_an_in_place_build_keeps_the_extensions_that_built(tmp_path: Path) -> None:
    """``pip install -e .`` builds in place: one extension failing (the first) stopped the
    copy into the source tree, so the two that built were dropped as well."""
    src, stderr = _build(tmp_path, "_hostcodec.c", "--inplace", "--build-lib", str(tmp_path / "lib"))
    assert _built(src) == {"kvwire.wire._crc32c", "kvwire.aio._sendq"}
    assert "WARNING: could not build kvwire.codec._hostcodec" in stderr
    assert "could not build the compiled extensions" not in stderr


@posix_only
def test_every_extension_that_compiles_is_built_in_place(tmp_path: Path) -> None:
    src, stderr = _build(tmp_path, "", "--inplace", "--build-lib", str(tmp_path / "lib"))
    assert _built(src) == set(EXTENSIONS) and "WARNING" not in stderr


# ---------------------------------------------------------------------------------------
# The suite where no extension was built: the tests of the compiled parts skip where there
# is no C compiler (a supported install), fail in CI or where a compiler is present.

#: one test of each compiled part's requirement (tests/conftest.py's one rule)
NEEDS_AN_EXTENSION = [
    "tests/wire/test_crc.py::test_extension_was_built",
    "tests/codec/test_host_codec.py::test_extension_was_built",
    "tests/codec/test_host_codec.py::test_compiled_entry_points_check_buffer_sizes",
    "tests/aio/test_sendq.py::test_the_extension_is_built",
    "tests/test_paged.py::test_quantized_chunks_read_and_land_where_the_blocks_lie[fp8-True]",
    "tests/aio/test_goaway_before_reset.py::"
    "test_a_sender_that_writes_before_reading_acts_on_the_goaway_it_had_not_read[send-queue]",
]
NONE_BUILT = (
    "import sys\n"
    f"for name in {sorted(EXTENSIONS)!r}:\n"
    "    sys.modules[name] = None  # as where none was built\n"
    "import pytest\n"
    "sys.exit(pytest.main(sys.argv[1:]))\n"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("compiler", "ci", "outcome"), [
    (False, False, "skipped"),
    (False, True, "failed"),
    (True, False, "failed"),
], ids=["no-compiler", "no-compiler-in-ci", "compiler"])
def test_tests_of_missing_extensions_skip_only_without_a_compiler(
    compiler: bool, ci: bool, outcome: str,
) -> None:
    environ = _environ(CC=sys.executable if compiler else "/nonexistent/cc")
    environ.pop("CI", None)
    if ci:
        environ["CI"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", NONE_BUILT, "-q", "-p", "no:cacheprovider", "-rfs", *NEEDS_AN_EXTENSION],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=280, check=False,
    )
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr
    assert summary.startswith(f"{len(NEEDS_AN_EXTENSION)} {outcome} in"), out.stdout[-3000:] + out.stderr


# ---------------------------------------------------------------------------------------
# Extras stay optional.


def test_star_import_of_consistency_without_redis() -> None:
    """Without redis-py, ``RedisRegistry`` was in ``__all__`` and the lazy lookup raised
    ImportError out of ``from kvwire.consistency import *`` (and inspect.getmembers)."""
    out = _python(
        "import sys\n"
        "sys.modules['redis'] = None  # redis-py not installed\n"
        "from kvwire.consistency import *\n"
        "import inspect, kvwire.consistency as c\n"
        "names = dict(inspect.getmembers(c))\n"
        "assert 'MemoryRegistry' in names and 'RedisRegistry' not in names\n"
        "assert 'RedisRegistry' not in c.__all__ and 'RedisRegistry' not in dir(c)\n"
        "assert MemoryRegistry is c.MemoryRegistry\n"
        "try:\n"
        "    c.RedisRegistry\n"
        "except ImportError as exc:\n"
        "    assert \"pip install 'kvwire[redis]'\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('RedisRegistry without redis-py')\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


def test_star_import_of_consistency_with_redis() -> None:
    import redis  # noqa: F401  (the test extra installs redis-py)
    out = _python(
        "from kvwire.consistency import *\n"
        "import kvwire.consistency as c\n"
        "assert 'RedisRegistry' in c.__all__ and RedisRegistry is c.RedisRegistry\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("site_packages", [True, False], ids=["installed", "without-site-packages"])
def test_mypy_of_the_redis_registry_with_or_without_redis(site_packages: bool, tmp_path: Path) -> None:
    """``pip install -e '.[dev]'`` brings mypy but not redis-py: there a ``type: ignore``
    for redis-py's types is unused, which strict mypy reported as an error.  Without the
    site-packages mypy sees no redis-py (nor numpy)."""
    import mypy  # noqa: F401  (the test and dev extras install mypy)
    flags = [] if site_packages else ["--no-site-packages"]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", *flags, "--no-incremental", "--cache-dir", str(tmp_path),
         "--follow-imports=silent", "--show-error-codes", "kvwire/aio/registry_redis.py"],
        cwd=ROOT, env=_environ(), capture_output=True, text=True, timeout=280, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------
# The sdist.


def test_the_license_is_apache_2_in_metadata_and_file() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.timeout(300)
def test_the_sdist_carries_the_whole_test_suite(tmp_path: Path) -> None:
    """The sdist carries tests/ whole (conftest files, every folder, tests/data) and what
    the tests read beside it, so the suite runs from an unpacked sdist."""
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
         "sdist", "--dist-dir", str(tmp_path / "dist"), "--formats", "gztar"],
        cwd=ROOT, env=_environ(KVWIRE_NO_EXTENSIONS="1"),  # lists no extension: sources still come
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [archive] = (tmp_path / "dist").glob("kvwire-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = {
        path.relative_to(ROOT).as_posix()
        for top in ("tests", "docs", "examples", "benchmarks", "fuzz")
        for path in (ROOT / top).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so")
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    }
    assert {"tests/conftest.py", "tests/data/minilm_kv.npz", "tests/system/__init__.py"} <= wanted
    assert not wanted - names, sorted(wanted - names)[:20]
    assert {"LICENSE", "README.md", "setup.py", "pyproject.toml", *EXTENSIONS.values()} <= names
    assert not [name for name in names if name.endswith((".so", ".pyc"))]
