"""kvcourse.serving.step_budget: the decode step's floors, the overlap bound, and the walk over the committed GPU
runs that chapter 9 quotes."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import kvcourse  # noqa: E402
from kvcourse.kernels.roofline import peak_for  # noqa: E402
from kvcourse.serving import step_budget as sb  # noqa: E402

SMOL = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}


def committed():
    # Chapter 9's: the H100 engine run the trace profile was taken beside, and the H100 runs by request count.
    run = kvcourse.results.load("gpu-engine-nvidia-h100-80gb-hbm3-2026-11-26.json")
    profile = kvcourse.results.load(kvcourse.results.newest("gpu-trace-profile-*.json"))
    first = kvcourse.results.load(kvcourse.results.find("gpu-trace-profile-*-first.json")[-1])
    runs = [kvcourse.results.load(n) for n in kvcourse.results.find("gpu-engine-nvidia-h100-*.json")]
    return run, profile, first, runs


def test_step_bytes_counts_weights_once_and_every_cached_token():
    assert sb.step_bytes(100, SMOL, [1], 2) == 200 + 2 * 30 * 3 * 64 * 2
    # the weights do not grow with the batch; the cache does, token for token
    one, two = sb.step_bytes(10**8, SMOL, [500], 2), sb.step_bytes(10**8, SMOL, [500, 500], 2)
    assert two - one == 23_040 * 500


def test_step_bytes_reads_a_model_config():
    model_config = kvcourse.model.LlamaConfig(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    assert sb.step_bytes(10, model_config, [4], 1) == sb.step_bytes(10, SMOL, [4], 1)


def test_floors_and_overlap():
    assert sb.bytes_floor_ms(3.35e12, 3.35e12) == 1000.0
    assert sb.kernel_floor_ms(343, 2.0) == pytest.approx(0.686)
    bound = sb.overlap_bound(2.42, 1.11, 1.79)
    assert bound["best_ms"] == 1.79 and bound["saving_ms"] == pytest.approx(0.63)
    assert bound["speedup"] == pytest.approx(2.42 / 1.79)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: sb.step_bytes(0, SMOL, [1]), "num_parameters"),
        (lambda: sb.step_bytes(10, {"num_hidden_layers": 30}, [1]), "num_key_value_heads"),
        (lambda: sb.step_bytes(10, SMOL, []), "seq_lens"),
        (lambda: sb.step_bytes(10, SMOL, [3, 0]), "seq_lens"),
        (lambda: sb.step_bytes(10, SMOL, [3], dtype_bytes=True), "dtype_bytes"),
        (lambda: sb.bytes_floor_ms(10, 0), "bandwidth"),
        (lambda: sb.kernel_floor_ms(-1, 2.0), "kernels"),
        (lambda: sb.overlap_bound(2.0, 3.0, 1.0), "step_ms"),
        (lambda: sb.overlap_bound(2.0, 1.0, float("nan")), "gpu_ms"),
        (lambda: sb.engine_run_lines({}), "run has no step_profile"),
        (lambda: sb.trace_split({"decode": {}}), "by_kind has no decode.parts_s"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_the_committed_runs_give_the_chapters_figures():
    run, profile, first, runs = committed()
    bandwidth = peak_for(profile["provenance"]["gpu"]).bandwidth
    f = sb.step_figures(run, profile, first, runs, 134_515_008, bandwidth)
    # the decode step's budget, every step from a graph: weights' floor < GPU span < step
    assert float(f["dec_weights_ms"]) < float(f["dec_gpu_ms"]) < float(f["dec_step_ms"])
    assert float(f["dec_overlap_ms"]) == pytest.approx(float(f["dec_step_ms"]) - float(f["dec_gpu_ms"]), abs=0.011)
    assert int(f["gpu_launches"]) > 100 and f["gpu_name"].startswith("H100")
    lines = sb.engine_run_lines(run, "gpu-engine.json")
    assert lines[0].startswith("gpu-engine.json: NVIDIA") and any("graphs on" in line for line in lines)


def test_step_figures_refuse_runs_that_no_longer_say_what_the_prose_says():
    run, profile, first, runs = committed()
    broken = {**run, "step_profile": {**run["step_profile"]}}
    on = broken["step_profile"]["graphs_on"] = {**run["step_profile"]["graphs_on"]}
    on["batches"] = {
        **on["batches"],
        "64": {**on["batches"]["64"], "profile": {**on["batches"]["64"]["profile"], "sync_ops": 2.0}},
    }
    with pytest.raises(ValueError, match="a replayed step never waits"):
        sb.step_figures(broken, profile, first, runs, 134_515_008, 3.35e12)


def test_trace_split_adds_up_and_plots():
    _, profile, _, _ = committed()
    before, after = profile["runs"]["decode-graphs"]["by_kind"], profile["runs"]["graphs"]["by_kind"]
    split = sb.trace_split(after)
    assert sum(split.values()) == pytest.approx(after["all"]["seconds"], abs=0.01)
    fig, ax = plt.subplots()
    sb.plot_trace_split(before, after, ax)
    assert len(ax.patches) == 8 and "not" in ax.get_title()
    plt.close(fig)


def test_measuring_live_needs_a_gpu():
    class CpuModel:
        device = __import__("torch").device("cpu")

    with pytest.raises(ValueError, match="model must be on a CUDA device"):
        sb.measure_decode_step(CpuModel(), 4)
