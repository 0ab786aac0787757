"""How jaxinfer installs and starts: the wheel, a plain install tested from a checkout, the version,
every command's help, the bundled model from any directory."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cli_helpers import jaxinfer


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout, as `pip install .` builds it (without the compiled kernels: setup.py
    is left out, so the build takes seconds)."""
    pytest.importorskip("setuptools")
    repo, tmp_path = Path(__file__).parent.parent, tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    for name in ("jaxinfer", "cli", "models"):
        shutil.copytree(repo / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    return next(tmp_path.glob("jaxinfer-*.whl"))


def test_the_wheel_installs_the_front_end_inside_jaxinfer(wheel):
    """No top-level `cli` package another distribution could shadow, or lose when uninstalled."""
    wheel = zipfile.ZipFile(wheel)
    assert {name.split("/")[0] for name in wheel.namelist()} == {
        "jaxinfer",
        wheel.filename.split("/")[-1].split("-py3")[0] + ".dist-info",
    }
    assert "jaxinfer/cli/main.py" in wheel.namelist() and "jaxinfer/__main__.py" in wheel.namelist()
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "jaxinfer = jaxinfer.cli.main:main" in wheel.read(entry_points).decode()


@pytest.mark.slow
def test_the_suite_run_in_a_checkout_tests_a_plain_install(wheel, tmp_path):
    """After `pip install .` (not -e), `python -m pytest` in the checkout puts the checkout's jaxinfer/
    first on the path, which has no jaxinfer.cli nor jaxinfer.models: conftest takes the install."""
    import sysconfig

    installed = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", installed, wheel]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    # -S: no site, so no .pth file maps jaxinfer to this checkout as the editable install does; the
    # dependencies still come from the environment's site-packages
    paths = dict.fromkeys([installed, *(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))])
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "tests/test_parameters.py",
            "-k",
            "word",
        ],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"jaxinfer from {installed / 'jaxinfer'} (installed), kernels: not built" in proc.stdout


def test_version_python_dash_m_and_a_bare_command_showing_help():
    version = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "--version"], capture_output=True, text=True, timeout=300
    )
    assert version.returncode == 0 and version.stdout.startswith("jaxinfer ")
    bare = jaxinfer()
    assert bare.returncode == 0 and "Commands:" in bare.stdout and "run" in bare.stdout and not bare.stderr


@pytest.mark.slow
def test_every_command_help_ends_with_examples_that_parse():
    """In this process (the command's own app; a process each took 17 s): the real command's help is
    shown by the other tests."""
    from typer.testing import CliRunner

    from jaxinfer.cli.main import EXAMPLES, app

    runner = CliRunner()
    for command, lines in EXAMPLES.items():
        assert runner.invoke(app, [command, "--help"]).stdout.rstrip().endswith(lines[-1])
        for line in lines:
            words = shlex.split(line.split("|")[-1].split(">")[0])[1:]  # the jaxinfer part of a pipeline
            shown = runner.invoke(app, [*words, "--help"])  # click checks every flag before it shows the help
            assert shown.exit_code == 0 and not shown.stderr, (line, shown.stderr, shown.exception)


@pytest.mark.slow
def test_bundled_model_is_the_default_from_any_directory(tmp_path):
    from jaxinfer.modeldir import bundled_model_dir

    prompt = "def fibonacci(n):" + " " * 300  # longer than a file name may be: not taken for a model directory
    args = ("run", prompt, "-n", "16", "--temp", "0", "--json")
    default = jaxinfer(*args, cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    explicit = jaxinfer(*args, "-m", bundled_model_dir())
    assert json.loads(default.stdout)["token_ids"] == json.loads(explicit.stdout)["token_ids"]
