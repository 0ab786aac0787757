"""Run as a process of its own, with 4 CPU devices (by `tests/test_sharding.py`): each model's greedy
tokens through run's engine and batch's runner at --devices 1 and 4, with what each device holds;
the first model's also with constrained rows, and with -q int8 at 1 and 2 devices (where its blocks
split: 2 runs nothing else, the suite's time); the second's run alone. With `--hybrid`: hybrids'
(`hybrid`), at 1 and 2 devices; with `--experts`: mixtures' (`experts`), at 1 and 2.
Prints one JSON object: {model path: {devices: {"run", "batch", "bytes", "cache", "converted", "int8",
"constrained", "fits"}}}."""

import json
import re
import sys
import tempfile
from pathlib import Path

import jax

if __name__ == "__main__":  # not when the test imports its prompts: that process keeps one device
    jax.config.update("jax_num_cpu_devices", 4)

from jaxinfer import kernel  # noqa: E402
from jaxinfer.constrain import Constraint  # noqa: E402
from jaxinfer.convert import convert  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.errors import JaxinferError  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from jaxinfer.roofline import Storage, state_bytes_per_row, weight_bytes  # noqa: E402
from jaxinfer.sampling import Sampling  # noqa: E402
from jaxinfer.scheduler import Request, Scheduler  # noqa: E402
from jaxinfer.sharding import bytes_per_device, device_mesh, mesh_of  # noqa: E402
from jaxinfer.slots import Decoding  # noqa: E402
from jaxinfer.state import Speculation  # noqa: E402

GREEDY = Sampling(temperature=0.0)
CHUNK = 16  # the long prompt goes in chunks
LONG = "The capital of France is Paris. The capital of Italy is Rome. Def fibonacci(n): return n if n < 2 else"
# Four requests, two rows; the last, longer than a chunk, is admitted in chunks beside a running row,
# whose decode step rides in the chunk's pass.
BATCH = {"a": ("The capital of France", 60), "b": ("Def fibonacci(n):", 12), "c": ("Emoji", 20), "d": (LONG, 10)}


def converted(path: str, model) -> bool:
    """Whether the orbax form of the model restores onto the same devices with the same shards."""
    with tempfile.TemporaryDirectory() as directory:
        restored = load_model(convert(path, Path(directory) / "converted"), mesh=mesh_of(model.params))
        pairs = zip(jax.tree.leaves(model.params), jax.tree.leaves(restored.params))
        return all(a.sharding == b.sharding and bool((a == b).all()) for a, b in pairs)


def int8(path: str, devices: int) -> dict:
    """-q int8 as GPUs run it: dequantized in the graph, the matrices split by whole blocks (the CPU
    kernel's custom call takes whole matrices: with it they stay whole)."""
    kernel.enabled = False
    try:
        model = load_model(path, quantize="int8", mesh=device_mesh(devices))
        engine = Engine(model.config, model.params, 256, model.eos_ids, Decoding(CHUNK))
        run = [
            t
            for chunk in engine.generate(model.tokenizer.encode(LONG), GREEDY, 60, seed=0, ignore_eos=True)
            for t in chunk
        ]
        # what info says, from the config
        counted = weight_bytes(model.config, Storage.of_params(model.params), devices)
        return {"run": run, "bytes": bytes_per_device(model.params), "counted": counted}
    finally:
        kernel.enabled = True


def longest(model) -> int:
    """The longest context the memory check allows one row (it refuses 10⁹ positions, saying so)."""
    try:
        Engine(model.config, model.params, 10**9, model.eos_ids)
    except JaxinferError as e:
        return int(re.search(r"fits is (\d+)", str(e)).group(1))
    raise AssertionError("a 10⁹-position cache was allowed")


def batch(model) -> tuple[dict, dict]:
    """BATCH's greedy texts, beside two constrained rows and a free one that drafts, three rows at a
    time (one scheduler: the suite's time): the constrained rows' texts, and how often the matchers'
    host call ran (once a step, on the first device, `matchers.HostCall`: not once per device)."""
    constrained = [
        ("A list of words:", Constraint("regex", r"([a-z]+ )+")),
        ("Answer yes or no:", Constraint("choice", ("yes", "no"))),
        ("Free text", None),
    ]
    requests = [
        Request(i, model.tokenizer.encode(p), GREEDY, n, seed=0, ignore_eos=True) for i, (p, n) in BATCH.items()
    ] + [
        Request(i, model.tokenizer.encode(prompt), GREEDY, 24, seed=0, speculate=True, constraint=constraint)
        for i, (prompt, constraint) in enumerate(constrained)
    ]
    records = []
    scheduler = Scheduler(model, 3, 256, Decoding(CHUNK, speculation=Speculation(3)))  # the free row drafts
    scheduler.slots.constrain(model.tokenizer)
    scheduler.run(requests, records.append)
    texts = {r["id"]: r["text"] for r in records}
    return {i: texts[i] for i in BATCH}, {
        "texts": {i: texts[i] for i in range(len(constrained))},
        "calls": scheduler.slots.matchers.steps,
    }


def tokens(path: str, devices: int, first: bool) -> dict:
    """Run's tokens; the first model's also twice (the programs reused), batch's texts beside
    constrained rows, -q int8 (the second, MQA, splits differently: its run and what the devices hold)."""
    model = load_model(path, mesh=device_mesh(devices))
    if devices == 2:  # where int8's blocks split; run's and batch's splits are the 4 devices' (the suite's time)
        return {"bytes": bytes_per_device(model.params), "int8": int8(path, devices)}
    engine = Engine(model.config, model.params, 256, model.eos_ids, Decoding(CHUNK))
    run = [
        t for chunk in engine.generate(model.tokenizer.encode(LONG), GREEDY, 60, seed=0, ignore_eos=True) for t in chunk
    ]
    # over a mesh, a fresh state must fit the programs compiled for the one they made (as bench's repeats do)
    engine.reset()
    again = (
        [
            t
            for chunk in engine.generate(model.tokenizer.encode(LONG), GREEDY, 60, seed=0, ignore_eos=True)
            for t in chunk
        ]
        if devices > 1 and first
        else run
    )
    texts, constrained = batch(model) if first else ({}, None)
    return {
        "run": run,
        "again": again,
        "batch": texts,
        "bytes": bytes_per_device(model.params),
        "cache": str(engine.slots.state.cache.k[0].sharding.spec) if devices > 1 else "",
        "converted": devices == 4 and converted(path, model),
        "int8": int8(path, devices) if first and devices == 1 else None,
        "constrained": constrained,
        "fits": longest(model),
    }


def hybrid(path: str, devices: int) -> dict:
    """A hybrid's greedy text of LONG: on one device, run's; on more, a batch's that speculates (ngram
    drafts, the state settled on those kept) beside a row in its first chunks; with what each device
    holds of the DeltaNet layers' weights and how their state lies."""
    model = load_model(path, mesh=device_mesh(devices))
    prompt = model.tokenizer.encode(LONG)
    if devices == 1:
        engine = Engine(model.config, model.params, 256, model.eos_ids, Decoding(CHUNK))
        made = engine.generate(prompt, GREEDY, 12, seed=0, ignore_eos=True)
        text = model.tokenizer.decode([t for chunk in made for t in chunk])
        state = engine.slots.state.cache.delta
    else:
        requests = [
            Request(0, model.tokenizer.encode("Emoji"), GREEDY, 20, seed=0, ignore_eos=True),
            Request(1, prompt, GREEDY, 12, seed=0, ignore_eos=True, speculate=True),
        ]
        records = []
        scheduler = Scheduler(model, 2, 256, Decoding(CHUNK, speculation=Speculation(3)))
        scheduler.run(requests, records.append)
        text = next(r["text"] for r in records if r["id"] == 1)
        state = scheduler.slots.state.cache.delta
    delta = jax.tree.leaves({i: layer for i, layer in enumerate(model.params["layers"]) if "conv" in layer})
    storage = Storage.of_params(model.params)
    rows = len(state.recurrent[0])
    return {
        "text": text,
        "delta_bytes": bytes_per_device(delta),
        "state": [str(a.sharding.spec) if devices > 1 else "" for a in (state.conv[0], state.recurrent[0])],
        # what info and the memory check count, and what the devices hold
        "counted": [weight_bytes(model.config, storage, devices), state_bytes_per_row(model.config, storage, devices)],
        "held": [max(bytes_per_device(model.params)), max(bytes_per_device(state)) // rows],
    }


def experts(path: str, devices: int) -> dict:
    """A mixture's greedy tokens of LONG through run's engine, how its first mixture layer's stacks
    lie (over a mesh), and what each device holds against what info counts."""
    model = load_model(path, mesh=device_mesh(devices))
    engine = Engine(model.config, model.params, 256, model.eos_ids, Decoding(CHUNK))
    made = engine.generate(model.tokenizer.encode(LONG), GREEDY, 12, seed=0, ignore_eos=True)
    layer = next(layer for layer in model.params["layers"] if "router" in layer)
    return {
        "run": [t for chunk in made for t in chunk],
        "specs": {name: str(jax.tree.leaves(layer[name])[0].sharding.spec) for name in layer if name.startswith("we_")}
        if devices > 1
        else {},
        "held": max(bytes_per_device(model.params)),
        "counted": weight_bytes(model.config, Storage.of_params(model.params), devices),
    }


if __name__ == "__main__" and sys.argv[1] == "--experts":  # each mixture at 1 and 2 devices
    print(json.dumps({path: {n: experts(path, n) for n in (1, 2)} for path in sys.argv[2:]}))
elif __name__ == "__main__" and sys.argv[1] == "--hybrid":  # each hybrid at 1 and 2 devices
    print(json.dumps({path: {n: hybrid(path, n) for n in (1, 2)} for path in sys.argv[2:]}))
elif __name__ == "__main__":
    # The first model at 1, 2 and 4 devices; the second (MQA: its one kv head stays whole however
    # many devices there are) at 1 and 4.
    counts = ((1, 2, 4), (1, 4))
    print(
        json.dumps({path: {n: tokens(path, n, first=i == 0) for n in counts[i]} for i, path in enumerate(sys.argv[1:])})
    )
