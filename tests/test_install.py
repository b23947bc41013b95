"""dpgrad as a user installs it.

The source archive and the wheel that ``python -m build`` makes (the wheel built from the
archive, as build does) hold every module of dpgrad and of kernels/ (as ``dpgrad.kernels``) and
nothing of the tests or benchmarks; the wheel, installed in a new virtual environment, imports
and runs from outside the checkout. The supported torch and Triton ranges, written once in
dpgrad/supported_versions.py, are the ones pyproject.toml requires and the README states, and
importing dpgrad outside them warns once, naming the versions and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from dpgrad import supported_versions as sv
from dpgrad.version import __version__

ROOT = Path(__file__).resolve().parents[1]
# One worker builds once (make test runs pytest-xdist with --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_install")


def _tomllib():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib


# ------------------------------------------------------------------ the archives
def _source_files() -> list[str]:
    """The working tree's files as a commit would hold them: tracked, or new and not ignored."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files are the project's is git's answer")
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


def _modules(files: list[str]) -> set[str]:
    """Where each module of dpgrad/ and kernels/ lands in the wheel: kernels/ as dpgrad/kernels/."""
    out = set()
    for name in files:
        if name.endswith(".py") and name.startswith("dpgrad/"):
            out.add(name)
        elif name.endswith(".py") and name.startswith("kernels/"):
            out.add("dpgrad/" + name)
    return out


def _run_build(src: Path, dist: Path, isolation: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build", *([] if isolation else ["--no-isolation"]),
                           "--outdir", str(dist), str(src)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source files, sdist, wheel): ``python -m build`` of a copy of the working tree (so the
    build writes nothing into the checkout and sees only the project's files)."""
    pytest.importorskip("build")
    files = _source_files()
    base = tmp_path_factory.mktemp("install")
    src, dist = base / "src", base / "dist"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    proc = _run_build(src, dist, isolation=False)
    if proc.returncode != 0 and "Missing dependencies" in proc.stdout + proc.stderr:
        proc = _run_build(src, dist, isolation=True)  # this environment lacks the build backend
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Building wheel from sdist" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert [p.name for p in sdists] == [f"dpgrad-{__version__}.tar.gz"]
    assert [p.name for p in wheels] == [f"dpgrad-{__version__}-py3-none-any.whl"]
    return files, sdists[0], wheels[0]


def test_the_wheel_holds_every_module_and_nothing_else(built):
    files, _, wheel = built
    names = zipfile.ZipFile(wheel).namelist()
    info = f"dpgrad-{__version__}.dist-info/"
    assert {n.split("/", 1)[0] + "/" for n in names} == {"dpgrad/", info}, "only dpgrad and its metadata"
    expected = _modules(files)
    assert "dpgrad/kernels/backend.py" in expected and "dpgrad/tools/cli.py" in expected
    packaged = {n for n in names if not n.startswith(info)}
    assert packaged - expected == set(), "files in the wheel that are no module of the project"
    assert expected - packaged == set(), "modules missing from the wheel: list their package in pyproject.toml"
    entry_points = zipfile.ZipFile(wheel).read(info + "entry_points.txt").decode()
    assert "dpgrad = dpgrad.tools.cli:main" in entry_points


def test_the_source_archive_builds_the_wheel_and_leaves_out_the_tests(built):
    files, sdist, _ = built
    top = f"dpgrad-{__version__}/"
    with tarfile.open(sdist) as archive:
        names = {n[len(top):] for n in archive.getnames() if n.startswith(top)}
    expected = {n for n in files if n.endswith(".py") and n.split("/", 1)[0] in ("dpgrad", "kernels", "examples")}
    assert expected - names == set(), "files missing from the source archive (see MANIFEST.in)"
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in"} <= names
    assert not {n for n in names if n.split("/", 1)[0] in ("tests", "benchmarks", "docs", "build", "dist")}


def _venv_with_this_environment(path: Path) -> Path:
    """A new virtual environment that also sees this environment's packages (torch, Opacus) after
    its own, so nothing is downloaded. ``--system-site-packages`` would not do it: a virtual
    environment made from another one sees the base interpreter's site-packages, not its parent's.
    A path file adds this environment's site-packages as plain paths (their own path files, an
    editable install of this checkout among them, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (Path(own) / "outer_environment.pth").write_text("\n".join(outer) + "\n")
    return python


def test_the_wheel_installs_and_runs_outside_the_checkout(built, tmp_path):
    """Installed with pip in a new virtual environment, imported from elsewhere: dpgrad and its
    kernels come from that environment, importing it warns of no version, and the console script
    runs a DP training step. One process of that environment does both: the imports, then the
    console script that pip wrote (an executable file naming that environment's Python), run as
    its shebang would run it."""
    if importlib.util.find_spec("opacus") is None:  # the environment's Opacus, for dpgrad.opacus
        pytest.skip("opacus is not installed")
    files, _, wheel = built
    python = _venv_with_this_environment(tmp_path / "venv")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                           "--ignore-installed", "--no-index", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    script = tmp_path / "venv" / "bin" / "dpgrad"
    assert os.access(script, os.X_OK), "the console script is not executable"
    shebang = script.read_text().splitlines()[:2]
    assert shebang[0].startswith("#!") and any(str(python) in line for line in shebang), shebang
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DPGRAD_BACKEND="eager", DPGRAD_TUNE="off")
    code = ("import json, runpy, sys, warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import dpgrad, dpgrad.opacus, dpgrad.kernels\n"
            "versions = [str(w.message) for w in seen if w.category.__name__ == 'UnsupportedVersionWarning']\n"
            "print(json.dumps([dpgrad.__file__, dpgrad.kernels.__file__, dpgrad.__version__, versions]), flush=True)\n"
            "sys.argv = [sys.argv[1], 'demo', '--steps', '2', '--batch-size', '4', '--seq-len', '16']\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = subprocess.run([str(python), "-c", code, str(script)], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    imported, *demo = out.stdout.strip().splitlines()
    package, kernels, version, version_warnings = json.loads(imported)
    venv = str((tmp_path / "venv").resolve())
    assert package.startswith(venv) and package.endswith("dpgrad/__init__.py"), package
    assert kernels.startswith(venv) and kernels.endswith("dpgrad/kernels/__init__.py"), kernels
    assert version == __version__
    assert version_warnings == []

    rows = [line.split() for line in demo[2:]]
    assert [r[0] for r in rows] == ["1", "2"], out.stdout


# ------------------------------------------------------------------ the supported versions
def test_pyproject_requires_the_supported_ranges():
    project = _tomllib().loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = [r for r in project["dependencies"] if re.match(r"torch\b", r)]
    assert torch == [sv.requirement("torch")]
    extras = project["optional-dependencies"]
    assert extras["triton"] == [sv.requirement("triton")]
    # The dev environment's Triton is the newest supported one (the compile test's cache is keyed by it).
    dev_triton = [r for r in extras["dev"] if re.match(r"triton\b", r)]
    assert len(dev_triton) == 1 and sv.release(dev_triton[0].split("==")[1]) == sv.SUPPORTED["triton"][1]


def test_the_docs_state_the_supported_ranges():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert f"It needs {sv.described('torch')};" in readme
    assert f"{sv.described('triton')} (`[triton]`) for the kernels" in readme
    for name, label in (("torch", "torch"), ("triton", "Triton (`[triton]`)")):
        (lo, lo_minor), (hi, hi_minor) = sv.SUPPORTED[name]
        assert f"| {label} | {lo}.{lo_minor} to {hi}.{hi_minor} |" in index, name
    # Wherever a page states a range or a requirement, it is this one.
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for name in sv.SUPPORTED:
            label = "Triton" if name == "triton" else "torch"
            for found in re.findall(rf"\b{label} \d+\.\d+ to \d+\.\d+", text):
                assert found == sv.described(name), f"{page.name}: {found!r}"
            for found in re.findall(rf"\b{name}>=[\d.]+,<[\d.]+", text):
                assert found == sv.requirement(name), f"{page.name}: {found!r}"
        for found in re.findall(r"dist/dpgrad-([^-\s]+)(?:-py3-none-any\.whl|\.tar\.gz)", text):
            assert found == __version__, f"{page.name} names the wheel of version {found}"


@pytest.mark.parametrize("version, series", [
    ("2.13.0", (2, 13)), ("2.13.0+cpu", (2, 13)), ("2.14.0.dev20261101", (2, 14)), ("2.6.0a0+git1234abc", (2, 6)),
    ("2.10.1+cu128", (2, 10)), ("3.9.0", (3, 9)), ("1!2.7.0", (2, 7)), ("nightly", None), ("2", None),
])
def test_versions_are_read_by_release_series(version, series):
    assert sv.release(version) == series


def _with_versions(monkeypatch, **versions):
    real = sv.installed
    monkeypatch.setattr(sv, "installed", lambda name: versions[name] if name in versions else real(name))
    monkeypatch.setattr(sv, "_warned", False)


@pytest.mark.parametrize("name, version", [
    ("torch", "2.5.1"), ("torch", "2.14.0"), ("torch", "2.14.0.dev20261101"), ("torch", "3.0.0+cpu"),
    ("torch", "nightly"), ("triton", "3.5.0"), ("triton", "3.10.0"), ("triton", "4.0.0"),
])
def test_a_version_outside_its_range_warns(monkeypatch, name, version):
    _with_versions(monkeypatch, **{"torch": "2.13.0", "triton": "3.9.0", name: version})
    with pytest.warns(sv.UnsupportedVersionWarning) as seen:
        sv.warn_if_unsupported()
    assert len(seen) == 1
    message = str(seen[0].message)
    assert version in message and sv.described(name) in message, message
    assert f'pip install "{sv.requirement("torch")}" "{sv.requirement("triton")}"' in message
    other = "triton" if name == "torch" else "torch"
    assert sv.described(other) not in message, "only what is outside its range is named"


@pytest.mark.parametrize("torch_version, triton_version", [
    ("2.6.0", "3.6.0"), ("2.13.0+cpu", "3.9.0"), ("2.13.1", "3.9.1"), ("2.10.0+cu128", None),
])
def test_versions_inside_the_ranges_do_not_warn(monkeypatch, torch_version, triton_version):
    _with_versions(monkeypatch, torch=torch_version, triton=triton_version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sv.warn_if_unsupported()


def test_the_warning_comes_once_per_process(monkeypatch):
    _with_versions(monkeypatch, torch="2.5.1", triton="3.5.0")
    with pytest.warns(sv.UnsupportedVersionWarning) as seen:
        sv.warn_if_unsupported()
        sv.warn_if_unsupported()
    assert len(seen) == 1
    assert "2.5.1" in str(seen[0].message) and "3.5.0" in str(seen[0].message)


# The two checks of a fresh import of this checkout's dpgrad in one script: torch is imported,
# then the process forks, each side a process that has not imported dpgrad. The child, as a
# user's script would, sets an unsupported torch version and imports dpgrad; the parent, once
# the child has ended, imports it with the installed versions. Each prints a line of its own.
IMPORTS = """\
import json, os, sys, warnings
import torch
if os.fork() == 0:
    torch.__version__ = '2.14.0.dev20261101'
    import dpgrad.opacus
    import dpgrad
    print(json.dumps({"triton": 'triton' in sys.modules}), flush=True)
    sys.stderr.flush()
    os._exit(0)
_, status = os.wait()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    import dpgrad
print(json.dumps({"child": status, "warnings": [str(w.message) for w in seen
                                                if w.category.__name__ == 'UnsupportedVersionWarning']}))
"""
USERS_IMPORT_LINE = IMPORTS.splitlines().index("    import dpgrad.opacus") + 1


@pytest.fixture(scope="module")
def fresh_imports(tmp_path_factory) -> tuple:
    """(the process, {"triton": ...} of the child, {"child": its exit status, "warnings": ...} of
    the parent): ``IMPORTS`` run as a script of its own with this checkout's dpgrad."""
    if not hasattr(os, "fork"):
        pytest.skip("the script forks")
    tmp_path = tmp_path_factory.mktemp("imports")
    (tmp_path / "main.py").write_text(IMPORTS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    child = next((line for line in lines if "triton" in line), None)
    parent = next((line for line in lines if "warnings" in line), None)
    return proc, child, parent


def test_importing_dpgrad_warns_at_the_users_import_line(fresh_imports):
    """The real lookup of torch's version, an unsupported one set before dpgrad is imported: one
    warning, which points at the line of the user's script that imported dpgrad."""
    proc, child, parent = fresh_imports
    assert child is not None and parent is not None and parent["child"] == 0, proc.stderr[-3000:]
    assert proc.stderr.count("UnsupportedVersionWarning") == 1, proc.stderr
    assert f"main.py:{USERS_IMPORT_LINE}: UnsupportedVersionWarning: dpgrad" in proc.stderr, proc.stderr
    assert "2.14.0.dev20261101" in proc.stderr
    assert child["triton"] is False, "the check imports Triton"


def test_importing_dpgrad_with_the_installed_versions_does_not_warn(fresh_imports):
    assert sv.unsupported() == [], "this environment's torch or Triton is outside the supported ranges"
    proc, _, parent = fresh_imports
    assert proc.returncode == 0 and parent is not None, proc.stderr[-3000:]
    assert parent["warnings"] == [], parent
