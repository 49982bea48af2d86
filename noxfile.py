"""nox sessions of kernelattn.

Every session that needs torch installs ``torch==2.13.0`` first (the CPU build; an
unpinned torch pulls several GB of CUDA packages), then the core and every plugin
under ``plugins/`` as distributions, so tests go through real entry points.

* ``tests``  — core and plugin test suites (claims at the quick level)
* ``lint``   — ruff check and ruff format --check
* ``docs``   — Sphinx, warnings as errors
* ``formal`` — ``kernelattn verify --level full`` (every claim, every grid point) and AT002's
  power at full level (``pytest -m formal``); the same claims run at quick level in ``tests``
  (the plugins' conformance tests)
* ``bench``  — pytest-benchmark (not default)
* ``demo``   — installs everything and runs ``kernelattn compare`` (not default)
* ``tasks``  — the task benchmarks of docs/tasks.rst: ``kernelattn tasks --preset seeds`` and
  ``--preset zoology``, their tables and figures (not default; about an hour on two cores)
* ``floors`` — the declared minimum versions installed and the tests that use them run
  (not default; about ten minutes)
"""

from __future__ import annotations

import re
from pathlib import Path

import nox
import tomllib

nox.options.sessions = ["lint", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
PLUGINS = sorted(str(p) for p in (ROOT / "plugins").glob("kernelattn-*") if (p / "pyproject.toml").exists())
TUTORIAL = str(ROOT / "docs" / "tutorial" / "kernelattn-example")


def install_all(session: nox.Session, extras: str = "") -> None:
    """torch pinned, then the core and every plugin (with their test extras); ``extras``:
    more extras of the core (``"docs"``, ``"plot,cli"``), in the same requirement: pip
    does not merge the extras of one project named twice (``ROOT[test] ROOT[docs]``
    installed no Sphinx in a fresh-clone CI run)."""
    session.install(TORCH)
    core = f"{ROOT}[test,{extras}]" if extras else f"{ROOT}[test]"
    session.install(core, *(f"{p}[test]" for p in PLUGINS))


@nox.session
def tests(session: nox.Session) -> None:
    """Core and plugin tests, claims checked at the quick level."""
    install_all(session)
    session.install(TUTORIAL)
    session.run(
        "pytest",
        "tests",
        *(f"{p}/tests" for p in PLUGINS),
        f"{TUTORIAL}/tests",
        *session.posargs,
        env={"OMP_NUM_THREADS": "2"},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx docs with warnings as errors."""
    install_all(session, "docs")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", *session.posargs)
    session.run("python", "docs/check_offline.py", "docs/_build/html")  # MathJax is bundled: no CDN


@nox.session(default=False)
def formal(session: nox.Session) -> None:
    """Every declared claim at the full level, then AT002's power: on every shipped
    consistency claim, an estimator converging to softmax attention + 0.02 must fail."""
    install_all(session)
    session.install(TUTORIAL)
    session.run("kernelattn", "verify", "--level", "full", "--no-progress", *session.posargs)
    session.run("pytest", "-m", "formal", "tests/test_verify_power.py", env={"OMP_NUM_THREADS": "2"})


#: anchors of the engine benchmark, installed in the bench session only (torch stays pinned)
BENCH_ANCHORS = ("flash-linear-attention==0.6.0", "performer-pytorch==1.1.4")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (pytest-benchmark), compared as ratios within one run; the engine table
    (anchors SDPA, fla's pure-torch chunked form, performer-pytorch) is printed at the end
    and written to ``.benchmarks/engine_table.md`` (with page faults and peak memory)."""
    install_all(session)
    session.install(TORCH, *BENCH_ANCHORS)
    bench_only = ("-m", "benchmark", "--benchmark-only", "--benchmark-columns=min,median,max,rounds")
    session.run("pytest", "tests/benchmarks", *(f"{p}/tests" for p in PLUGINS), *bench_only, *session.posargs)
    # the figures of docs/benchmarks.rst
    session.install(f"{ROOT}[plot]")
    out = ROOT / "docs" / "_static" / "bench"
    compare = ("kernelattn", "compare", "--no-progress")
    session.run(*compare, "--plot", str(out / "compare.png"), "--output", str(out / "compare.csv"))
    lengths = ("--seq-len", "256", "1024", "4096", "--budgets", "64", "--seeds", "0")
    session.run(*compare, *lengths, "--plot", str(out / "time-vs-length.png"), "--output", str(out / "tl.csv"))


@nox.session(default=False)
def tasks(session: nox.Session) -> None:
    """The task benchmarks (docs/tasks.rst): what a small model learns with each estimator.

    ``-- --preset seeds`` (or ``zoology``) runs one preset only; results, tables and
    figures go to ``docs/_static/tasks/``."""
    install_all(session, "plot,cli")
    out = ROOT / "docs" / "_static" / "tasks"
    presets = [a.split("=", 1)[1] for a in session.posargs if a.startswith("--preset=")] or ["seeds", "zoology"]
    for preset in presets:
        session.run(
            "kernelattn",
            "tasks",
            "--preset",
            preset,
            "--no-progress",
            # one run at a time with both cores: every seeds run <= 45 s and the preset in
            # 26 min (2026-11-27); --jobs 2 ends a preset ~1.3x sooner, each run ~1.5x slower
            "--jobs",
            "1",
            "--output",
            str(out / f"{preset}.json"),
            "--plot",
            str(out / f"{preset}.png"),
            # an interrupted session, run again, trains only the runs it lacks (same code only)
            "--journal",
            str(ROOT / ".journal" / f"tasks-{preset}.jsonl"),
            env={"OMP_NUM_THREADS": "2"},
        )
    session.run("python", str(ROOT / "docs" / "tasks_tables.py"), str(out))
    session.run("python", str(ROOT / "docs" / "choosing_table.py"), str(out.parent))


@nox.session(default=False)
def choosing(session: nox.Session) -> None:
    """The tables of docs/choosing.rst: every linear estimator against the real attention of
    all-MiniLM-L6-v2 (``kernelattn compare --workload minilm``, about 1.5 min), then the
    tables from it, the tasks' ``seeds.json`` and the shipped conversions."""
    install_all(session, "hf")
    static = ROOT / "docs" / "_static"
    session.run(
        "kernelattn",
        "compare",
        "--workload",
        "minilm",
        "--budgets",
        "64",
        "128",
        "--no-progress",
        "--output",
        str(static / "choosing" / "minilm_compare.json"),
        env={"OMP_NUM_THREADS": "2"},
    )
    session.run("python", str(ROOT / "docs" / "choosing_table.py"), str(static))


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """Install the core (with plots, rich progress and the shipped MiniLM) and all plugins, then the
    compare demo on real attention: first rows within a minute, a summary and ``compare.png`` within
    three (``-- --all``: the full synthetic sweep)."""
    install_all(session, "plot,cli,hf")
    session.run("kernelattn", "plugins")
    session.run("kernelattn", "compare", "--plot", "compare.png", "--output", "compare.csv", *session.posargs)


#: not installed at their floors by ``floors``: torch stays pinned (no older CPU wheel is
#: reachable from CI), build tools, and what the session itself needs as it is
FLOOR_SKIP = {"torch", "triton", "setuptools", "wheel", "kernelattn-core", "kernelattn-prf", "sphinx"}
#: the tests that exercise each floor (the registry and plugins for pluggy, the symbolic
#: checks for sympy / mpmath, the fourier oracle for scikit-learn, the figures for
#: matplotlib, conversion and decoding for transformers; pytest, pytest-benchmark and
#: hypothesis run them all)
FLOOR_TESTS = (
    "tests/test_registry.py",
    "tests/test_registry_mistakes.py",
    "tests/test_docs_plugin_pages.py",
    "tests/test_verify.py",
    "tests/test_verify_mistakes.py",
    "tests/test_compare_figure.py",
    "tests/test_convert.py",
    "tests/test_decoder.py",
    "plugins/kernelattn-maclaurin/tests",
    "plugins/kernelattn-fourier/tests/test_fourier_oracle.py",
)


#: floors checked after the tests, without pytest (which needs newer versions of them)
FLOOR_WITHOUT_PYTEST = ("pluggy",)
#: builds the registry from the installed plugins' entry points and runs every estimator once
FLOOR_REGISTRY_CHECK = """
import importlib.metadata as md, torch, kernelattn_core as ka
print("pluggy", md.version("pluggy"), "plugins", len(ka.list_plugins()))
assert len(ka.list_plugins()) >= 7, ka.list_plugins()
q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
for name in ("prf", "rff", "rmfa", "hedgehog", "ra", "cexp", "softmax"):
    out = ka.kernel_attention(q, k, v, ka.create(name), causal=False)
    assert bool(torch.isfinite(out).all()), name
"""


def declared_floors() -> dict[str, str]:
    """``{package: version}``: the highest ``>=`` floor each package is given by the
    dependencies and the ``test`` / ``hf`` / ``plot`` / ``cli`` extras of the core and the
    plugins (the floors that apply when they are installed together)."""
    floors: dict[str, str] = {}
    for path in [ROOT / "pyproject.toml", *(Path(p) / "pyproject.toml" for p in PLUGINS)]:
        project = tomllib.loads(path.read_text())["project"]
        extras = project.get("optional-dependencies", {})
        reqs = list(project.get("dependencies", []))
        reqs += [r for e in ("test", "hf", "plot", "cli") for r in extras.get(e, [])]
        for req in reqs:
            m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9.]*)\s*", req.split(";")[0])
            if m is None or m.group(1).lower() in FLOOR_SKIP:
                continue
            name, version = m.group(1).lower(), m.group(2)
            key = tuple(int(x) for x in version.split("."))
            if name not in floors or key > tuple(int(x) for x in floors[name].split(".")):
                floors[name] = version
    return floors


@nox.session(default=False)
def floors(session: nox.Session) -> None:
    """Install every declared floor (``declared_floors``) over the usual environment and run
    the tests that use them: a floor that does not work fails here, not for a user. A
    package that fails to import at its floor fails the session (a test that skips when
    it is missing would skip silently)."""
    install_all(session, "plot,cli,hf")
    floors = declared_floors()
    # pytest itself needs a newer pluggy (8.2: >= 1.5): pluggy's floor is checked after
    # the tests, through the command line and the registry, without pytest
    alone = {n: floors.pop(n) for n in FLOOR_WITHOUT_PYTEST if n in floors}
    pins = [f"{n}=={v}" for n, v in sorted(floors.items())]
    session.log("floors: " + " ".join(pins))
    session.install(TORCH, *pins)
    session.run("python", "-c", "import sympy, mpmath, sklearn, matplotlib, transformers")
    session.run("pytest", *FLOOR_TESTS, "-p", "no:cacheprovider", *session.posargs, env={"OMP_NUM_THREADS": "2"})
    for name, version in alone.items():
        session.log(f"floor without pytest: {name}=={version}")
        session.install(f"{name}=={version}")
    session.run("python", "-c", FLOOR_REGISTRY_CHECK)
    session.run("kernelattn", "plugins")
    session.run("kernelattn", "verify", "prf", "--level", "quick", "--no-progress")
