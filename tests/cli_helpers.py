"""Running the installed `jaxinfer` command as a user would, and what its failures must look like."""

import os
import subprocess


def jaxinfer(*args, stdin=None, cache=None, cwd=None, env=()):
    """The command in a process of its own; `cache` its compiled-program cache ("": none; None: the
    test session's, conftest's $JAXINFER_CACHE_DIR)."""
    cache = os.environ.get("JAXINFER_CACHE_DIR", "") if cache is None else cache
    return subprocess.run(
        ["jaxinfer", *map(str, args)],
        input=stdin,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAXINFER_CACHE_DIR": str(cache), **dict(env)},
    )


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def jaxinfer_here(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The command's `main()` in this process, as `jaxinfer` runs it: its exit code, stdout and stderr
    (a process of its own starts JAX again, ~1 s a call). Not for what only a process shows: global
    flags set as JAX starts (-t), signals, a traceback under --debug, closed streams."""
    import contextlib
    import io
    import signal
    import sys
    from unittest import mock

    from jaxinfer.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    sigterm = signal.getsignal(signal.SIGTERM)
    with (
        mock.patch.object(sys, "argv", ["jaxinfer", *map(str, args)]),
        mock.patch.object(sys, "stdin", io.TextIOWrapper(io.BytesIO((stdin or "").encode()))),
        mock.patch.dict(os.environ, {"JAXINFER_CACHE_DIR": ""}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code or 0
        finally:
            signal.signal(signal.SIGTERM, sigterm)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
