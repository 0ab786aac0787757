"""Per-phase FLOPs and bytes from the config, held against XLA's cost analysis of the compiled
programs; the machine ceilings; MFU/MBU in the run output."""

import jax
import pytest
from kernel_helpers import xla_dot

from jaxinfer import ceilings, kernel
from jaxinfer.decode import decode_step, prefill
from jaxinfer.loading import load_model
from jaxinfer.roofline import Cost, Storage, decode_step_cost, phase_report, prefill_cost
from jaxinfer.sampling import Sampling
from jaxinfer.state import admission, initial_state

S = 256


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(tiny, request):
    # proportions of a real model (matmuls dominate), small enough to compile in a second; on XLA's
    # dot, whose cost XLA can count (a custom call's it cannot). Gemma 3: GeGLU, four norms a layer,
    # q/k norms, sliding and global layers.
    return load_model(tiny(request.param, hidden_size=256, num_hidden_layers=4, intermediate_size=640), layout="out_in")


def xla_state(model):
    """An empty state whose cache XLA attends (the attention kernel's custom call it cannot count)."""
    with xla_dot():
        return initial_state(model.config, model.params, 1, S, model.eos_ids)


def xla_cost(compiled) -> tuple[float, float]:
    analysis = compiled.cost_analysis()
    return analysis["flops"], analysis["bytes accessed"]


@pytest.mark.parametrize("tokens", [16, 128])
def test_prefill_flops_match_xla_within_5_percent(model, tokens):
    state = xla_state(model)
    admit = admission([0], [[1] * tokens], [0], [tokens], [S], [0], [Sampling()], [False], [False], tokens)
    flops, bytes_accessed = xla_cost(
        prefill.lower(model.params, state, *admit, cfg=model.config, kv_len=tokens).compile()
    )
    ours = prefill_cost(model.config, Storage(4), tokens)
    assert ours.flops == pytest.approx(flops, rel=0.05)
    # XLA also counts every intermediate (attention scores, activations): ours is the floor
    assert ours.bytes <= bytes_accessed


def test_decode_step_flops_and_bytes_match_xla(model):
    state = xla_state(model)
    step = (
        jax.jit(decode_step, static_argnames=("cfg", "kv_len"))
        .lower(model.params, state, cfg=model.config, kv_len=S)
        .compile()
    )
    flops, bytes_accessed = xla_cost(step)
    ours = decode_step_cost(model.config, Storage(4), kv_len=S)  # a step attending over the whole cache
    assert ours.flops == pytest.approx(flops, rel=0.05)
    assert ours.bytes <= bytes_accessed <= 1.4 * ours.bytes  # weights and cache dominate


def test_intensity_decides_the_bound_and_batch_raises_it(model):
    cfg = model.config
    # weights shared by the rows
    one, eight = (
        decode_step_cost(cfg, Storage(4), 64),
        decode_step_cost(cfg, Storage(4), 64, batch=8),
    )
    assert eight.intensity > 4 * one.intensity
    assert prefill_cost(cfg, Storage(4), 512).intensity > 50 * one.intensity
    roofs = dict(peak_flops=100e9, peak_bandwidth=10e9)  # balance: 10 FLOP/byte
    report = phase_report(Cost(flops=2e9, bytes=1e8), 0.1, **roofs)  # 20 FLOP/byte
    assert report["bound"] == "compute" and report["mfu"] == pytest.approx(0.2) and report["mbu"] == pytest.approx(0.1)
    assert phase_report(Cost(flops=1e8, bytes=1e8), 0.1, **roofs)["bound"] == "memory"


def test_ceilings_are_measured_once_per_machine_and_overrides_win(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(ceilings, "measure_peak_flops", lambda dtype: calls.append(dtype) or 1e11)
    monkeypatch.setattr(ceilings, "measure_bandwidth", lambda: (1e10, 2e10, 1.5e10))
    first = ceilings.machine_ceilings("float32")
    again = ceilings.machine_ceilings("float32")
    assert calls == ["float32"] and first == again and "measured" in first.method
    assert (first.peak_flops, first.peak_bandwidth) == (1e11, 2e10)  # the highest of copy, sum and matvec
    given = ceilings.machine_ceilings("bfloat16", peak_flops=5e14, peak_bandwidth=3e12)
    assert calls == ["float32"] and (given.peak_flops, given.peak_bandwidth) == (5e14, 3e12) and "given" in given.method
    # jaxinfer info --measure: probe again, and keep each roof's best (a busy machine probes low)
    monkeypatch.setattr(ceilings, "measure_peak_flops", lambda dtype: calls.append(dtype) or 5e10)
    monkeypatch.setattr(ceilings, "measure_bandwidth", lambda: (1e10, 1e10, 3e10))
    again = ceilings.machine_ceilings("float32", remeasure=True)
    assert (
        calls == ["float32"] * 2
        and (again.peak_flops, again.peak_bandwidth) == (1e11, 3e10)
        and "best of 2 probes" in again.method
    )
    assert ceilings.machine_ceilings("float32") == again  # kept


def test_the_measurements_themselves_are_plausible():
    assert 1e8 < ceilings.measure_peak_flops("float32", n=256) < 1e16
    assert all(1e8 < rate < 1e14 for rate in ceilings.measure_bandwidth(nbytes=16 * 2**20))


# untied, tied embeddings; 4 norms and q/k norms a layer; fused projections
@pytest.mark.parametrize("arch", ["llama", "llama3-scaled", "gemma3", "phi3"])
def test_info_counts_what_transformers_counts(tiny, arch):
    import json
    import subprocess

    import transformers

    path = tiny(arch)
    proc = subprocess.run(
        ["jaxinfer", "info", "-m", path, "--json", "-c", "128", "-b", "2"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert facts["parameters"] == hf.num_parameters()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Phi-3's config has none
    assert facts["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    assert facts["total_bytes"] == facts["parameters"] * 4 + facts["kv_bytes_per_token"] * 128 * 2
    assert facts["longest_context_that_fits"] * facts["kv_bytes_per_token"] * 2 <= facts["device_memory_bytes"]
    assert 0 < facts["predicted_ttft_s"] and 0 < facts["predicted_itl_s"]


@pytest.mark.slow
def test_bench_sweeps_every_point_with_spread_roofline_and_plot(tiny, tmp_path):
    import json
    import subprocess

    args = ["jaxinfer", "bench", "-m", tiny("llama"), "-p", "16,32", "-n", "6", "-b", "1,2", "-r", "2"]
    proc = subprocess.run([*args, "--json", "--plot", tmp_path / "bench.png"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    points = json.loads(proc.stdout)["points"]
    assert [(p["prompt_tokens"], p["batch"]) for p in points] == [(16, 1), (32, 1), (16, 2), (32, 2)]
    for p in points:
        assert p["ttft_s"]["min"] <= p["ttft_s"]["median"] <= p["ttft_s"]["max"]
        assert p["decode_tok_s"]["median"] > 0 and p["itl_ms"]["p50"] <= p["itl_ms"]["p99"]
        assert p["prefill"]["mfu"] > 0 and p["decode"]["mbu"] > 0 and p["compile_s"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each batch size on its fastest layout: the kernel's wherever it is built
    assert [p["layout"] for p in points] == (
        ["packed"] * 4 if kernel.vectorised() else ["out_in", "out_in", "in_out", "in_out"]
    )
    assert all(p["kv_buckets"] == [p["prompt_tokens"] + 6] for p in points)  # the cache is just prompt + new tokens
    bad = subprocess.run([*args[:4], "-p", "16,x"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "error: --prompt-tokens takes positive whole numbers separated by commas, not '16,x'"
    ]


@pytest.mark.slow
def test_bench_with_a_large_cache_reads_only_the_buckets_reached(tiny):
    import json
    import subprocess

    args = [
        "jaxinfer",
        "bench",
        "-m",
        tiny("llama", max_position_embeddings=1024),
        "-p",
        "16",
        "-n",
        "6",
        "-b",
        "1",
        "-r",
        "1",
    ]
    proc = subprocess.run([*args, "-c", "1024", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (point,) = json.loads(proc.stdout)["points"]
    assert point["max_context"] == 1024 and point["kv_buckets"] == [128]
    small = subprocess.run([*args, "-c", "20"], capture_output=True, text=True)
    assert small.returncode == 1 and small.stderr.strip().splitlines() == [
        "error: the prompt (16 tokens) + --max-tokens (6) exceeds the context of 20; shorten the prompt, lower "
        "--max-tokens or raise --max-context"
    ]


def test_the_bench_table_fits_80_columns_and_never_cuts_a_figure(monkeypatch):
    import io

    from rich.console import Console

    from jaxinfer.cli import render

    def row(scale, devices):  # the README's B=16 point; scaled up, figures wider than any column allows
        return {
            "prompt_tokens": 448,
            "batch": 16,
            "prefill_tok_s": 13950.4 * scale,
            "prefill": {"mfu": 0.763},
            "decode": {"mbu": 0.203},
            "ttft_s": {"median": 0.5138 * scale, "min": 0.5071 * scale, "max": 0.5302 * scale},
            "decode_tok_s": {"median": 2261.3 * scale, "min": 2210.4 * scale, "max": 2290.9 * scale},
            "itl_ms": {"p50": 7.01, "p99": 9.29},
            "compile_s": 4.96,
            "devices": devices,
        }

    for scale, folded, devices in ((1, False, 1), (1, False, 4), (10_000, True, 1)):  # 4 devices: a column more
        monkeypatch.setattr(render, "out", Console(file=io.StringIO(), width=80, highlight=False, soft_wrap=True))
        render.bench_table([row(scale, devices)], "caption")
        text = render.out.file.getvalue()
        assert "…" not in text and max(map(len, text.splitlines())) <= 80  # folded onto more lines, never cut
        if not folded:
            for figure in (
                "448",
                "514",
                "(507–530)",
                "13950",
                "76.3%",
                "2261",
                "(2210–2291)",
                "7.01",
                "9.29",
                "20.3%",
                "4.96",
            ):
                assert figure in text, figure


def test_no_home_at_all_costs_only_the_caches(monkeypatch):
    from pathlib import Path

    from jaxinfer import runtime

    def no_home():
        raise RuntimeError("Could not determine home directory.")  # no $HOME and no passwd entry

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("JAXINFER_CACHE_DIR", raising=False)
    with pytest.raises(OSError):  # the CLI turns it into one warning and runs without the cache
        runtime.enable_compilation_cache()
    monkeypatch.setattr(ceilings, "measure_peak_flops", lambda dtype: 1e11)
    monkeypatch.setattr(ceilings, "measure_bandwidth", lambda: (1e10, 2e10, 1.5e10))
    assert ceilings.machine_ceilings("float32").peak_bandwidth == 2e10  # measured, not stored


@pytest.mark.parametrize(
    "method,dtype", [(None, "float32"), ("int8", "float32"), ("int4", "float32"), (None, "bfloat16")]
)
def test_weight_bytes_are_what_the_loaded_tree_holds(tiny, method, dtype):
    """The roofline and `info` count the bytes as stored: quantized blocks and their scales;
    bfloat16 matrices beside the float32 norms of the kernel's layout."""
    from jaxinfer.model import compute_dtype
    from jaxinfer.roofline import weight_bytes

    # tied embedding, head_dim 24; in bfloat16 an embedding of whole groups of 16 rows, which the
    # kernel's layout keeps in bfloat16 as it does the other matrices
    path = tiny("llama3-scaled", **({"vocab_size": 400} if dtype == "bfloat16" else {}))
    loaded = load_model(path, dtype, quantize=method)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(loaded.params))
    assert weight_bytes(loaded.config, Storage.of_params(loaded.params)) == held
    computed = compute_dtype(loaded.params).itemsize
    stored = Storage.of_params(loaded.params)  # and each matrix's method (`methods`)
    itemsize = 2 if dtype == "bfloat16" else 4
    assert (stored.itemsize, stored.quantize, stored.cache_itemsize) == (itemsize, method, computed)


def test_packed_bfloat16_is_roofed_by_the_kernels_own_product(tiny):
    """On the CPU kernel a bfloat16 model's matrices run its bfloat16 product (AMX where the CPU has
    it, past XLA's float32 matmul), so that is the compute roof its MFU is a share of; elsewhere the
    compute dtype's."""
    loaded = load_model(tiny("llama", dtype="bfloat16"), "bfloat16")
    assert loaded.computed_in == ("float32" if kernel.vectorised() else "bfloat16")
    assert loaded.roofed_in == "bfloat16"
    assert load_model(tiny("llama")).roofed_in == "float32"
