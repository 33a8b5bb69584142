"""Kernels a decode step, counted on a CPU (issue 49, item 2): :mod:`kvcourse.bench.launch_count`.

The counter stands in for the GPU profiler's ``kernel_launches``: on the committed H200 run the engine's decode step
(CUDA graphs, SmolLM2's 30 layers) launched 342 kernels at batch 1, 11 a layer. With RoPE, the cache write, paged
attention and its merge in one kernel (:mod:`kvcourse.kernels.triton_fused_decode`) a layer launches 8, and the
embedding lookup shares the first layer's norm: 249 a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcourse.bench.launch_count import count_launches, decode_step_launches
from kvcourse.kernels.triton_runtime import interpreting
from kvcourse.model import LlamaConfig, LlamaModel

pytestmark = pytest.mark.skipif(not interpreting(), reason="counts launches in Triton's interpreter (a CPU)")
RESULTS = Path(__file__).resolve().parents[1] / "kvcourse" / "results"


def _model(layers: int) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return LlamaModel(config).eval()


def test_counts_aten_kernels_and_triton_launches_not_views_or_host_work():
    x, host = torch.randn(4, 8), torch.arange(3)
    counts = count_launches(lambda: (x.view(8, 4).t() @ x.T, x[:, :2].sum(), host + 1), device_tensors=[x])
    assert counts == {"aten.mm": 1, "aten.sum": 1}  # views launch nothing; host + 1 is host work


def test_a_decode_step_is_eight_kernels_a_layer_and_ten_around_them():
    counts = decode_step_launches(_model(3), batch_size=2, context=20)
    assert counts["per_layer"] == [7, 8, 8]  # the first layer's norm is the embedding's kernel
    # 4 matmuls, 2 norms, SiLU-and-mul and the fused attention a layer.
    assert counts["by_kernel"]["triton._rope_cache_decode_kernel"] == 3
    assert counts["by_kernel"]["aten.mm"] == 3 * 4 + 1  # and the head
    # Around them: the 4 copies into the graph's buffers and the hidden rows out, the embedding with the first norm,
    # the final norm, head, argmax and the tokens' read back.
    assert counts["by_kernel"]["triton._rms_norm_kernel"] == 1 and "aten.embedding" not in counts["by_kernel"]
    assert counts["outside_layers"] == 10
    assert counts["total"] == 3 * 8 - 1 + 10


def test_the_unfused_step_is_the_eleven_a_layer_the_gpu_profile_counted(monkeypatch):
    """The same step through the unfused launches: rotary, cache write, paged kernel, merge. SmolLM2's 30 layers
    give the H200 profile's count at batch 1, 342 (343 at batch 16 and 64), but for the embedding's kernel, which
    the first layer's norm now shares (kvcourse.kernels.fused.embed_rms_norm)."""
    from kvcourse.backends.triton import TritonBackend

    monkeypatch.setattr(TritonBackend, "fuse_attention", False)
    counts = decode_step_launches(_model(2), batch_size=2, context=20)
    assert counts["per_layer"] == [10, 11] and counts["outside_layers"] == 12
    run = json.loads(next(RESULTS.glob("gpu-engine-nvidia-h200-*.json")).read_text())
    profiled = run["step_profile"]["graphs_on"]["batches"]["1"]["profile"]["kernel_launches"]
    assert 30 * 11 + counts["outside_layers"] == profiled == 342  # the embedding's kernel back in the first layer


def test_the_fused_step_keeps_the_engine_tokens(monkeypatch):
    """Greedy tokens of the fused step equal the unfused step's (fp32)."""
    from kvcourse.backends.triton import TritonBackend
    from kvcourse.serving.model_runner import ModelRunner

    model = _model(2)

    def tokens() -> list[list[int]]:
        runner = ModelRunner(model, 16, 16, backend="triton", cuda_graphs="eager", max_num_seqs=2)
        out = [runner.step([(0, [5, 6, 7]), (1, [9] * 20)]).argmax(-1).tolist()]
        for _ in range(4):
            out.append(runner.step([(b, [t]) for b, t in enumerate(out[-1])]).argmax(-1).tolist())
        return out

    fused = tokens()
    monkeypatch.setattr(TritonBackend, "fuse_attention", False)
    assert tokens() == fused
