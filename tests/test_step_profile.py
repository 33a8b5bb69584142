"""profile_step (chapter 6's "where a step goes") and the packed, fused layer against the textbook one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcourse.model import apply_rope, pack_state_dict
from kvcourse.serving import ModelRunner
from kvcourse.serving.step_profile import profile_step

from .conftest import tiny_llama


def test_a_decode_step_is_profiled_and_its_forward_never_reads_back():
    model = tiny_llama(4)
    runner = ModelRunner(model, 32, 4)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7, 8])])
    cost = profile_step(lambda: runner.step([(0, [9]), (1, [10])]), repeats=2)
    assert cost["aten_calls"] > 100 and cost["wall_ms"] > 0
    assert cost["forward_sync_ops"] == 0 < cost["sync_ops"]  # the host reads its own lists while building the batch
    assert "kernel_launches" not in cost  # CUDA-only figures
    with pytest.raises(TypeError, match="step"):
        profile_step(3)
    with pytest.raises(ValueError, match="repeats"):
        profile_step(lambda: None, repeats=0)


def _textbook_layer(layer, x, cos, sin, eps):
    """A decoder layer op by op (separate projections, rotate-half RoPE twice, unfused adds), attention
    replaced by its queries: chapter 6 prints this beside the package's layer."""
    a, n = layer.self_attn, x.shape[0]
    h = layer.input_layernorm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    q = apply_rope(a.q_proj(h).view(n, a.n_heads, a.head_dim), cos, sin)
    x = x + a.o_proj(q.reshape(n, -1))
    h = layer.post_attention_layernorm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))


@pytest.mark.parametrize("seed", range(3))
def test_the_packed_fused_layer_equals_the_textbook_layer(seed):
    model = tiny_llama(seed)
    layer = model.layers[1]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(3, 8)
    cos, sin = model.rope_tables(positions)
    with torch.inference_mode():
        want = _textbook_layer(layer, x, cos[positions][:, None], sin[positions][:, None], model.config.rms_norm_eps)
        out, residual = layer(x, None, *model.rope_rows(positions), lambda i, q, k, v: q)
    torch.testing.assert_close(out + residual, want, rtol=1e-5, atol=1e-5)


def test_hugging_face_names_are_packed_row_by_row():
    model = tiny_llama(0)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hf = {"layers.0.self_attn.q_proj.weight": attn.q_proj.weight, "layers.0.self_attn.k_proj.weight": attn.k_proj.weight,
          "layers.0.self_attn.v_proj.weight": attn.v_proj.weight, "layers.0.mlp.gate_proj.weight": mlp.gate_proj.weight,
          "layers.0.mlp.up_proj.weight": mlp.up_proj.weight, "norm.weight": model.norm.weight}  # fmt: skip
    packed = pack_state_dict(hf)
    assert set(packed) == {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight", "norm.weight"}
    assert torch.equal(packed["layers.0.self_attn.qkv_proj.weight"], attn.qkv_proj.weight)
    assert torch.equal(packed["layers.0.mlp.gate_up_proj.weight"], mlp.gate_up_proj.weight)
    assert pack_state_dict(packed).keys() == packed.keys()  # already packed: unchanged
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(attn.k_proj(x), F.linear(x, hf["layers.0.self_attn.k_proj.weight"]))


# ---- busy and idle time from kernel intervals (issue 49: device-busy time above wall time under graphs) ------
def test_busy_time_counts_overlapping_intervals_once():
    from kvcourse.serving.step_profile import busy_time

    assert busy_time([]) == 0
    assert busy_time([(0, 2), (5, 6)]) == 3  # apart: the durations add
    assert busy_time([(0, 4), (1, 2), (3, 6)]) == 6  # nested and overlapping: the union
    # A labelled span covering its kernels (what summing device times counted twice under graph replay).
    kernels = [(10, 12), (12, 15), (20, 21)]
    assert busy_time(kernels + [(10, 21)]) == busy_time([(10, 21)]) == 11
    assert busy_time([(3, 4), (0, 1)]) == 2  # order does not matter
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_time([(2, 1)])


def test_idle_fraction_is_the_wall_time_no_kernel_ran():
    from kvcourse.serving.step_profile import idle_fraction

    assert idle_fraction([(0, 6), (8, 10)], 10) == pytest.approx(0.2)
    assert idle_fraction([(0, 10), (2, 4)], 10) == 0  # overlap never makes the GPU "more than busy"
    assert idle_fraction([], 5) == 1
    with pytest.raises(ValueError, match="wall"):
        idle_fraction([(0, 1)], 0)


def test_device_figures_mix_the_profilers_microseconds_with_wall_seconds_right():
    """The first H200 run reported an idle fraction of 0 for a step busy 1.43 ms of 3.31: the kernels' intervals
    (microseconds) were divided by the wall time in milliseconds."""
    from kvcourse.serving.step_profile import device_figures

    # Two steps of 3.3 ms wall each, 1.4 ms of kernels in each.
    intervals = [(0.0, 700.0), (700.0, 1400.0), (5000.0, 6400.0)]
    got = device_figures(intervals, [3.3e-3, 3.3e-3])
    assert got["kernel_launches"] == 1.5 and got["device_busy_ms"] == pytest.approx(1.4)
    assert got["kernel_sum_ms"] == pytest.approx(1.4)
    assert got["gpu_idle_fraction"] == pytest.approx(1 - 1.4 / 3.3)
