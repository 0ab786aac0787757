"""Running the installed `jaxinfer` command as a user would, and what its failures must look like."""

import os
import subprocess


def jaxinfer(*args, stdin=None, cache="", cwd=None, env=()):
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
