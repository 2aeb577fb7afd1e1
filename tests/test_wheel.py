"""Packaging, as a user gets it: the lock, the built wheel's contents, and (slow) the wheel in a fresh venv.

The wheel is built with `pip wheel --no-deps --no-build-isolation` from a clean copy of the sources that
pyproject.toml names (a build in the repository itself would leave build/ there, and a stale build/lib can
slip deleted modules into the wheel). The slow test installs it into a new venv that sees the test venv's
dependencies through a .pth file, not the editable install of the project: Python adds a .pth file's path
lines to sys.path but does not process the .pth files in those folders, so the editable finder stays off (the
test checks that too). It then runs `ermedrag demo` and imports every graph from a folder outside the repo.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
LOCK = REPO / "constraints.txt"
# Repository folders that are subpackages of `ermedrag` once installed, and folders that never ship.
NOT_TOP_LEVEL = ("graphs", "agents", "tools", "training", "evals", "tests", "benches")
GRAPH_TARGETS = {
    "ermedrag.graphs.er_medrag.graph",
    "ermedrag.graphs.baselines.cot",
    "ermedrag.graphs.baselines.vanilla_rag",
    "ermedrag.graphs.med_r3.graph",
}
# The demo answers with the offline Gemma model (~40 s on 2 cores); the first run on a machine converts the
# model into ~/.cache/ermedrag and builds the starter index, hence the generous limit.
DEMO_TIMEOUT_S = 900
STEP_TIMEOUT_S = 300


def _tail(proc: subprocess.CompletedProcess[str], chars: int = 4000) -> str:
    return (
        f"exit code {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-chars:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-chars:]}"
    )


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _proc(
    cmd: list[str | Path], what: str, timeout: float = STEP_TIMEOUT_S, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; fail the test with its output's tail if it runs past `timeout`."""
    try:
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"{what}: no result within {timeout:.0f}s\n--- stdout (tail) ---\n{_text(err.stdout)[-4000:]}\n"
            f"--- stderr (tail) ---\n{_text(err.stderr)[-4000:]}"
        )


def _run(cmd: list[str | Path], what: str, timeout: float = STEP_TIMEOUT_S, **kwargs) -> str:
    """Run a command; fail the test with its output's tail unless it exits 0. Returns its stdout."""
    proc = _proc(cmd, what, timeout, **kwargs)
    assert proc.returncode == 0, f"{what} failed: {' '.join(map(str, cmd))}\n{_tail(proc)}"
    return proc.stdout


# --- the lock -------------------------------------------------------------------------------------------------


def _makefile_extras(variable: str) -> list[str]:
    """The extras a Makefile variable names: EXTRAS (what `make install` installs) or SOURCE_EXTRAS (built from
    source by `make llamacpp`); `make lock` pins both."""
    makefile = (REPO / "Makefile").read_text()
    match = re.search(rf"^{variable}\s*:?=\s*(\S+)\s*$", makefile, re.MULTILINE)
    assert match, f"the Makefile names no {variable}: the extras that `make install` and `make lock` install"
    return match.group(1).split(",")


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and " @ " not in line, f"{LOCK.name}: {line!r} is not a plain `name==version` pin"
            pins[canonicalize_name(name)] = version
    return pins


def _required_closure(requirements: list[str]) -> tuple[dict[str, str], list[str]]:
    """Every installed distribution that `requirements` need, with markers and extras followed
    (name -> installed version), and the requirements that no installed distribution satisfies."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    extras_seen: dict[str, set[str]] = {}
    missing = []
    todo = [(Requirement(r), "ermedrag") for r in requirements]
    while todo:
        req, parent = todo.pop()
        name = canonicalize_name(req.name)
        if name not in installed:
            missing.append(f"{req} (needed by {parent})")
            continue
        extras = set(req.extras)
        if name in extras_seen and extras <= extras_seen[name]:
            continue
        extras_seen[name] = extras_seen.get(name, set()) | extras
        for text in installed[name].requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *extras_seen[name]]):
                todo.append((sub, name))
    return {name: installed[name].version for name in extras_seen}, missing


def _installed_closure(extras: list[str], how: str) -> dict[str, str]:
    """The installed dependency closure of ermedrag[extras] (name -> version); fails naming what is missing."""
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        assert extra in project["optional-dependencies"], f"the Makefile names an unknown extra {extra!r}"
        requirements += project["optional-dependencies"][extra]
    closure, missing = _required_closure(requirements)
    assert not missing, f"not installed: {missing}: run {how} (`make lock` for a new dependency)"
    closure.pop("ermedrag", None)
    return closure


def _assert_locked_at_installed_versions(closure: dict[str, str], pins: dict[str, str]) -> None:
    unlocked = sorted(set(closure) - set(pins))
    assert not unlocked, f"dependencies missing from {LOCK.name}: {unlocked}: run `make lock`"
    differ = {name: (closure[name], pins[name]) for name in closure if closure[name] != pins[name]}
    assert not differ, f"installed version differs from {LOCK.name} (installed, locked): {differ}: run `make install`"


def test_lock_pins_the_dependencies_of_the_installed_extras_at_the_installed_versions() -> None:
    """Every dependency of ermedrag[EXTRAS] (what `make test` installs) is pinned in constraints.txt, at the
    version installed here. The source-built extras are checked by the `llamacpp` test below."""
    assert LOCK.exists(), f"{LOCK.name} is missing: run `make lock`"
    pins = _pins()
    assert "ermedrag" not in pins, f"{LOCK.name} pins the project itself"
    assert pins["torch"].startswith("2.13.0"), f"torch must stay 2.13.0 (the CPU build); the lock has {pins['torch']}"
    _assert_locked_at_installed_versions(_installed_closure(_makefile_extras("EXTRAS"), "`make install`"), pins)


@pytest.mark.llamacpp
def test_lock_pins_exactly_the_dependencies_of_every_extra() -> None:
    """constraints.txt = the dependency closure of ermedrag[EXTRAS,SOURCE_EXTRAS], each at its installed version:
    nothing missing, nothing extra."""
    extras = _makefile_extras("EXTRAS") + _makefile_extras("SOURCE_EXTRAS")
    closure = _installed_closure(extras, "`make install` and `make llamacpp`")
    pins = _pins()
    _assert_locked_at_installed_versions(closure, pins)
    unneeded = sorted(set(pins) - set(closure))
    assert not unneeded, f"{LOCK.name} pins packages that ermedrag[{','.join(extras)}] does not need: {unneeded}"


# --- the wheel ------------------------------------------------------------------------------------------------


def _source_dir(package: str) -> Path:
    """The repository folder of an installed package name, by [tool.setuptools.package-dir]."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        root = SETUPTOOLS["package-dir"].get(".".join(parts[:i]))
        if root is not None:
            return REPO / root / Path(*parts[i:])
    return REPO / Path(*parts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built offline from a clean copy of what pyproject.toml names."""
    if importlib.util.find_spec("setuptools") is None:  # --no-build-isolation builds with this venv's setuptools
        pytest.fail("setuptools is not installed in the test venv: run `make install`")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"].get("readme", "README.md")):
        shutil.copy2(REPO / name, source / name)
    for folder in sorted(set(SETUPTOOLS["package-dir"].values())):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = work / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            out,
            source,
        ],
        "building the wheel",
    )
    (built,) = out.glob("ermedrag-*.whl")
    return built


def test_wheel_ships_every_module_and_data_file_under_ermedrag_only(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    version = wheel.name.split("-")[1]
    dist_info = f"ermedrag-{version}.dist-info"
    top = {name.split("/")[0] for name in names}
    assert top == {"ermedrag", dist_info}, f"the wheel's top level must be ermedrag and {dist_info}; it has {top}"
    assert not top & set(NOT_TOP_LEVEL)

    # Every module of every listed package, and no package folder that pyproject.toml forgot to list.
    packages = SETUPTOOLS["packages"]
    expected = set()
    for package in packages:
        folder = _source_dir(package)
        assert (folder / "__init__.py").exists(), f"package {package}: no {folder}/__init__.py"
        expected |= {f"{package.replace('.', '/')}/{f.name}" for f in folder.glob("*.py")}
        for init in folder.glob("*/__init__.py"):
            sub = f"{package}.{init.parent.name}"
            assert sub in packages, f"{init.parent} is a package but [tool.setuptools] packages lacks {sub}"
    assert not expected - names, f"modules missing from the wheel: {sorted(expected - names)}"

    # Data files: the starter knowledge base and the training configs.
    assert "ermedrag/tools/data/starter_kb/passages.jsonl" in names
    configs = sorted(p.name for p in _source_dir("ermedrag.training").glob("configs/*.yaml"))
    assert configs, "no training/configs/*.yaml in the repository"
    missing = [c for c in configs if f"ermedrag/training/configs/{c}" not in names]
    assert not missing, f"training configs missing from the wheel: {missing}"

    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert re.search(r"^ermedrag\s*=\s*ermedrag\.cli:run$", entry_points, re.MULTILINE), entry_points


# What the fresh venv runs after `import` of every registered graph: where each came from, and whether the
# editable install of the repository leaked in.
IMPORT_CHECK = """
import importlib, json, sys
import ermedrag, yaml
from ermedrag.graphs.registry import GRAPHS
graphs = {}
for name, spec in GRAPHS.items():
    module = importlib.import_module(spec.module)
    graph = getattr(module, spec.attribute)
    graphs[f"{spec.module}.{spec.attribute}"] = {"file": module.__file__,
                                                  "invoke": callable(getattr(graph, "invoke", None))}
print(json.dumps({
    "ermedrag": ermedrag.__file__, "yaml": yaml.__file__, "graphs": graphs, "sys_path": sys.path,
    "editable": [m for m in sys.modules if "__editable__" in m]
                + [repr(f) for f in sys.meta_path if "ditable" in repr(f)],
}))
"""


def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_demo_and_imports_every_graph_outside_the_repo(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], "creating the fresh venv")
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            "locating the fresh venv's site-packages",
        ).strip()
    )
    assert _inside(site, venv), site
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    for name in (
        "ERMEDRAG_INDEX_DIR",
        "ERMEDRAG_MODEL",
        "ERMEDRAG_EXTRACTOR_MODEL",
        "ERMEDRAG_RESPONDENT_MODEL",
        "OPENAI_BASE_URL",
        "ERMEDRAG_SNIPPETS_K",
        "ERMEDRAG_COARSE_K",
    ):
        env.pop(name, None)
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        ANONYMIZED_TELEMETRY="False",
        ERMEDRAG_TRACE_DB=str(tmp_path / "traces.sqlite"),
        ERMEDRAG_CHECKPOINT_DB=str(tmp_path / "checkpoints.sqlite"),
    )
    outside = tmp_path / "outside"
    outside.mkdir()
    assert not _inside(outside, REPO), f"the temporary folder {outside} lies inside the repository"

    # The test venv's dependencies, through a .pth file of path lines. Its own .pth files (the editable finder
    # of the project among them) are not processed: without the wheel, `ermedrag` must not import.
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    pth = site / "_ermedrag_test_dependencies.pth"
    pth.write_text("".join(f"{d}\n" for d in deps))
    proc = _proc(
        [python, "-c", "import ermedrag; print(ermedrag.__file__)"],
        "importing ermedrag before the wheel",
        cwd=outside,
        env=env,
    )
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (
        "before the wheel is installed, `import ermedrag` must fail in the fresh venv (else the editable install "
        f"leaks in through the .pth file):\n{_tail(proc)}"
    )
    pth.unlink()  # pip must see an empty venv: it installs the wheel only, and touches nothing of the test venv

    before = set(os.listdir(site))
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        "installing the wheel into the fresh venv",
        cwd=outside,
        env=env,
    )
    gained = set(os.listdir(site)) - before
    version = wheel.name.split("-")[1]
    assert gained == {"ermedrag", f"ermedrag-{version}.dist-info"}, (
        f"installing the wheel must add only ermedrag and its dist-info to site-packages; it added {sorted(gained)}"
    )
    assert not set(NOT_TOP_LEVEL) & set(os.listdir(site))
    assert (venv / "bin" / "ermedrag").exists(), "the wheel installed no `ermedrag` command"
    pth.write_text("".join(f"{d}\n" for d in deps))

    imported = json.loads(
        _run(
            [python, "-c", IMPORT_CHECK], "importing every graph from the fresh venv", cwd=outside, env=env
        ).splitlines()[-1]
    )
    assert _inside(imported["ermedrag"], site), f"ermedrag imported from {imported['ermedrag']}, not {site}"
    assert any(_inside(imported["yaml"], Path(d)) for d in deps), f"dependencies not seen: yaml at {imported['yaml']}"
    assert not imported["editable"], f"the editable install leaked in: {imported['editable']}"
    leaked = [p for p in imported["sys_path"] if p and _inside(p, REPO) and p not in deps]  # .venv lies in REPO
    assert not leaked, f"the repository is on the fresh venv's sys.path: {leaked}"
    missing = GRAPH_TARGETS - set(imported["graphs"])
    assert not missing, f"graphs not in ermedrag.graphs.registry.GRAPHS: {missing}"
    for target, info in imported["graphs"].items():
        assert _inside(info["file"], site), f"{target} imported from {info['file']}, not from {site}"
        assert info["invoke"], f"{target} is not a runnable graph"

    demo = _proc(
        [venv / "bin" / "ermedrag", "demo"], "`ermedrag demo` from the wheel", DEMO_TIMEOUT_S, cwd=outside, env=env
    )
    assert demo.returncode == 0, f"`ermedrag demo` from the wheel failed:\n{_tail(demo)}"
    assert re.search(r"^Answer: \S+", demo.stdout, re.MULTILINE), f"no answer line:\n{_tail(demo)}"
    assert re.search(r"^Run id: [0-9a-f]{32} ", demo.stdout, re.MULTILINE), f"no run id line:\n{_tail(demo)}"
    assert not list(outside.iterdir()), f"the demo wrote into its working folder: {list(outside.iterdir())}"
