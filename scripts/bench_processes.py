"""One model over devices in one process against the same devices in several processes (jax.distributed).

    python scripts/bench_processes.py --processes 2 --devices 2

The bundled model, run's engine, a `--prompt`-token prompt and `--tokens` greedy tokens, best of
`--repeats` warm runs (compile excluded), three ways in one sitting: one device; `--devices` devices
in one process (`--devices N`); the same count spread over `--processes` processes joined on loopback
(`--coordinator`; this script starts them). Prints one line per way: TTFT and decode tok/s.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time


def measure(
    devices: int,
    processes: int = 1,
    process_id: int = 0,
    coordinator: str = "",
    prompt: int = 128,
    tokens: int = 64,
    repeats: int = 3,
) -> str:
    from jaxinfer.processes import join
    from jaxinfer.sharding import device_mesh

    mesh = device_mesh(devices, join(coordinator, processes, process_id) if processes > 1 else 1)
    from jaxinfer.engine import Engine
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import Sampling

    model = load_model(None, mesh=mesh)
    engine = Engine(model.config, model.params, prompt + tokens + 1, model.eos_ids)
    ids = (model.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * prompt)[:prompt]
    best_ttft, best_decode = float("inf"), 0.0
    for _ in range(repeats + 1):  # the first compiles
        engine.reset()
        gen = engine.generate(ids, Sampling(temperature=0.0), tokens, seed=0, ignore_eos=True, stream=False)
        for _ in gen.chunks:
            pass
        t = gen.timings
        best_ttft, best_decode = min(best_ttft, t.ttft_s), max(best_decode, (t.generated_tokens - 1) / t.decode_s)
    return (
        f"{devices} device(s), {processes} process(es): TTFT {1000 * best_ttft:.1f} ms, decode {best_decode:.1f} tok/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # set in the processes this starts
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = dict(prompt=args.prompt, tokens=args.tokens, repeats=args.repeats)
    if args.process_id is not None:
        print(measure(args.devices, args.processes, args.process_id, args.coordinator, **shape), flush=True)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    for devices in (1, args.devices):  # each in a process of its own: the CPU's devices are set when JAX starts
        command = [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, 'scripts'); import bench_processes as b; print(b.measure({devices}, "
            f"**{shape!r}))",
        ]
        print(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip(), flush=True)
    started = time.perf_counter()
    joined = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--process-id", str(i), "--coordinator", coordinator],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(args.processes)
    ]
    outputs = [p.communicate()[0] for p in joined]  # gloo prints its connections on stdout, before our line
    print(
        outputs[0].strip().splitlines()[-1]
        if outputs[0].strip()
        else f"the processes failed (exit codes {[p.returncode for p in joined]})",
        f"({time.perf_counter() - started:.0f} s)",
    )


if __name__ == "__main__":
    main()
