"""Mixed steps (prompts beside decodes) from CUDA graphs (issue 29): the bookkeeping here, the capture on a GPU.

On a CPU, :class:`MixedGraphs` with ``capture=False`` runs the padded, static-buffer forward a graph would
record, eagerly, in Triton's interpreter: bucket choice, buffer filling and padding are tested, and the
tokens must equal the eager engine's in fp32. ``make gpu-check`` runs the ``cuda`` cases, which capture.
"""

from __future__ import annotations

import pytest
import torch

import kvcourse
from kvcourse.batch import SeqSlice
from kvcourse.kernels.triton_runtime import kernel_device
from kvcourse.serving import Engine, ModelRunner
from kvcourse.serving.cuda_graphs import DecodeGraphs
from kvcourse.serving.mixed_graphs import MixedGraphs, token_buckets

from .conftest import real_model_on, tiny_llama
from .test_cuda_graphs import padding_nan, sync_ops

kernels_on_cpu = pytest.mark.skipif(kernel_device().type != "cpu",
                                    reason="Triton kernels take cuda tensors in this process, not cpu ones")


def test_token_buckets_double_up_to_the_step_budget():
    assert token_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert token_buckets(1500) == [64, 128, 256, 512, 1024, 2048]
    assert token_buckets(8) == [64]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def _mixed(model, num_blocks=32, block_size=4, max_num_seqs=3, max_tokens=64):
    runner = ModelRunner(model, num_blocks, block_size, backend="triton", cuda_graphs=False)
    return runner, MixedGraphs(model, runner.kv_store, max_num_seqs, max_tokens, capture=False)


def test_a_step_fills_the_static_buffers_and_pads_rows_and_lanes():
    _, graphs = _mixed(tiny_llama(1))
    seqs = [SeqSlice([7, 8, 9], 2, [3, 9]), SeqSlice([5], 4, [4, 1])]
    last = graphs.load_inputs(seqs, 64)
    assert graphs.input_ids[:5].tolist() == [7, 8, 9, 5, 0]
    assert graphs.positions[:5].tolist() == [2, 3, 4, 4, 0]
    # Slot = block_table[pos // 4] * 4 + pos % 4; padding rows write nowhere.
    assert graphs.slot_mapping[:5].tolist() == [3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 1 * 4 + 0, -1]
    assert (graphs.slot_mapping[4:64] == -1).all()
    assert graphs.seq_lens.tolist() == [5, 5, 0]  # the spare lane reads no key
    assert graphs.query_start_loc.tolist() == [0, 3, 4, 4]  # and owns no row
    assert graphs.block_tables[:2, :2].tolist() == [[3, 9], [4, 1]]
    assert last.tolist() == [2, 3]  # each sequence's last row: where its logits come from
    with pytest.raises(ValueError, match="does not cover position 5"):
        graphs.load_inputs([SeqSlice([1, 2], 4, [0])], 64)


def test_only_steps_that_fit_run_from_a_graph():
    _, graphs = _mixed(tiny_llama(1), max_num_seqs=2, max_tokens=64)
    assert graphs.can_run([SeqSlice([1] * 40, 0, list(range(10))), SeqSlice([2], 3, [11])])
    assert not graphs.can_run([SeqSlice([1] * 65, 0, list(range(17)))])  # more tokens than the largest bucket
    assert not graphs.can_run([SeqSlice([1], 0, [0])] * 3)  # more sequences than lanes
    with pytest.raises(ValueError, match="at most 2 sequences and 64 tokens"):
        graphs.run([SeqSlice([1], 0, [0])] * 3)


def _serve(model, graphs: str, **engine):
    """Prompts arriving while others decode: mixed steps, prefill-only steps and decode-only steps."""
    prompts = [[1, 5, 9, 13, 2, 6], [3, 7], [11] * 19, [4, 8, 12], [9, 9, 9, 9, 9, 9, 9, 9, 9]]
    params = [kvcourse.SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (9, 4, 7, 12, 2)]
    eng = Engine(model, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, backend="triton",
                 cuda_graphs=graphs == "captured", **engine)  # fmt: skip
    if graphs == "static":
        runner = eng.runner
        runner.graphs = DecodeGraphs(model, runner.kv_store, "triton", 4, capture=False)
        runner.mixed_graphs = MixedGraphs(model, runner.kv_store, 4, 8, capture=False)
    return eng.generate(prompts, params), eng


@padding_nan
@pytest.mark.parametrize("seed", [0, 1])
def test_every_step_from_a_graph_gives_the_eager_tokens(seed, kernels_on):
    """fp32, token for token: every step of the workload is served by a graph (or its eager twin on a CPU)."""
    device = kernels_on
    model = tiny_llama(seed).to(device)
    eager, _ = _serve(model, "off")
    got, eng = _serve(model, "captured" if device.type == "cuda" else "static")
    assert got == eager
    runner = eng.runner
    assert runner.graph_steps == len(eng.events)  # every step
    assert runner.graphs.replays > 0 and runner.mixed_graphs.replays > 0  # of both kinds


@kernels_on_cpu
@padding_nan
def test_mixed_graphs_with_prefix_caching_give_the_eager_tokens():
    model = tiny_llama(3)
    eager, _ = _serve(model, "off", enable_prefix_caching=True)
    got, eng = _serve(model, "static", enable_prefix_caching=True)
    assert got == eager and eng.runner.mixed_graphs.replays > 0


@kernels_on_cpu
def test_the_static_mixed_forward_neither_waits_nor_copies_from_the_host(monkeypatch):
    model = tiny_llama(2)
    runner, graphs = _mixed(model)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    runner.block_manager.append_slots(0, 1)
    runner.block_manager.allocate(2, 0)
    start = kvcourse.paged.allocate_slots(runner.block_manager, runner.kv_store, 2, 3)
    table = runner.block_manager.block_table
    graphs.load_inputs([SeqSlice([8], 5, table(0)), SeqSlice([9, 10, 11], start, table(2))], 64)
    assert sync_ops(lambda: graphs.forward(64)) == {}

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor made from host data inside the recorded forward")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    graphs.forward(64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_mixed_steps_of_the_real_model_equal_eager_cuda(model, tok):
    """The real model in fp32 on the GPU, chunked prefill beside decodes: the tokens of an engine whose
    every step replays a graph are the eager engine's, and a replayed mixed step never synchronises."""
    model_on = real_model_on(model, torch.device("cuda"))
    texts = ("The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
             "The KV cache stores")  # fmt: skip
    prompts = [tok.encode(t) * 3 for t in texts]
    params = [kvcourse.SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (24, 9, 17, 30)]
    runs = {}
    for graphs in (False, True):
        eng = Engine(model_on, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                     backend="triton", cuda_graphs=graphs)  # fmt: skip
        runs[graphs] = (eng.generate(prompts, params), eng.runner.graph_steps, len(eng.events))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[True][2] and runs[False][1] == 0
    runner = ModelRunner(model_on, 16, 16, backend="triton", cuda_graphs=True, max_num_seqs=4,
                         max_num_batched_tokens=64)  # fmt: skip
    runner.step([(0, prompts[0])])  # records the bucket of 64 (a prompt alone is a step of this kind too)
    runner.step([(0, [5]), (1, prompts[1])])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.step([(0, [7]), (2, prompts[2][:20])])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, model_on.config.vocab_size) and runner.mixed_graphs.replays == 3


def test_after_a_kernel_fell_back_mixed_steps_run_eagerly():
    """A kernel that falls back to torch reads the static batch's host copies, which describe the graph,
    not the step."""
    _, graphs = _mixed(tiny_llama(1))
    graphs.fell_back = True
    step = [SeqSlice([1, 2], 0, [0])]
    assert graphs.can_run(step) and not graphs.ready(step)
    with pytest.raises(ValueError, match="fell back: True"):
        graphs.run(step)


@kernels_on_cpu
def test_static_buffers_are_loaded_from_host_tensors_made_on_the_cpu_on_purpose():
    """With torch's default device set to meta, loading a step into either kind of graph still works: its host
    tensors say ``device="cpu"`` rather than following the default (they did not, once)."""
    model = tiny_llama(6)
    runner, mixed = _mixed(model)
    decode = DecodeGraphs(model, runner.kv_store, "triton", 4, capture=False)
    runner.step([(0, [1, 2, 3, 4, 5])])
    runner.block_manager.append_slots(0, 1)
    step = [SeqSlice([7], 5, runner.block_manager.block_table(0))]
    torch.set_default_device("meta")
    try:
        mixed.load_inputs(step, 64)
        decode.load_inputs(step, 1)
    finally:
        torch.set_default_device(None)
    assert mixed.input_ids[0].item() == decode.input_ids[0].item() == 7
