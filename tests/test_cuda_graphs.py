"""Steps from CUDA graphs (issues 29 and 51): the bookkeeping on any machine, the capture on a GPU.

On a CPU, :class:`StepGraphs` with ``capture=False`` (``cuda_graphs="eager"``) runs the padded, static-buffer
forward a graph would record, eagerly, in Triton's interpreter: bucket choice, buffer filling, padding rows and
lanes, the graph a step is looked up in, and the eager fallback are tested here, for decode steps and mixed
steps. On a GPU (``make gpu-check`` runs the ``cuda`` cases) the engine records real graphs when it starts and
must give the eager engine's tokens, token for token, in fp32.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import profile

import kvcourse
from kvcourse.batch import ForwardBatch, SeqSlice
from kvcourse.kernels.triton_runtime import kernel_device
from kvcourse.serving import Engine, ModelRunner
from kvcourse.serving.step_graphs import StepGraphs, bucket_for, graph_batch_sizes, token_buckets
from kvcourse.serving.step_profile import SYNC_OPS

from .conftest import real_model_on, tiny_llama


def sync_ops(fn, within: str | None = None) -> collections.Counter:
    """The synchronising ops ``fn()`` runs, counted by torch's profiler (only those under a
    ``record_function(within)`` scope, if given: host-side work on CPU tensors outside it is no sync)."""
    with profile() as prof:
        fn()

    def inside(e) -> bool:
        while e is not None:
            if e.name == within:
                return True
            e = e.cpu_parent
        return within is None

    return collections.Counter(e.name for e in prof.events() if e.name in SYNC_OPS and inside(e))


# The static forward on CPU tensors runs chapter 5's kernels there: only in Triton's interpreter. A process
# that compiles them for a GPU (make gpu-check) skips these; its cuda cases test the capture itself.
kernels_on_cpu = pytest.mark.skipif(
    kernel_device().type != "cpu", reason="Triton kernels take cuda tensors in this process, not cpu ones"
)

# A padding lane has no key to attend to: its row of the decode kernel divides 0 by 0 (a NaN nobody reads,
# in a row no other row mixes with). Triton's CPU interpreter computes it with NumPy, which warns.
padding_nan = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")


def test_buckets_are_nano_vllms():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]  # the last bucket holds max_num_seqs
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 48, 49)] == [1, 4, 8, 16, 32, 48, None]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_token_buckets_double_up_to_the_step_budget():
    assert token_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert token_buckets(1500) == [64, 128, 256, 512, 1024, 2048]
    assert token_buckets(8) == [64]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def _graphs(model, num_blocks=32, block_size=4, max_num_seqs=6, max_tokens=64):
    runner = ModelRunner(model, num_blocks, block_size, backend="triton", cuda_graphs=False)
    return runner, StepGraphs(model, runner.kv_store, "triton", max_num_seqs, max_tokens, capture=False)


def test_a_step_fills_the_static_buffers_and_pads_the_bucket():
    model = tiny_llama(1)
    _, graphs = _graphs(model)
    assert graphs.decode_sizes == [1, 2, 4, 8]
    seqs = [SeqSlice([7], 5, [3, 9]), SeqSlice([8], 0, [4]), SeqSlice([9], 8, [1, 2, 6])]
    assert graphs.lookup(seqs) == ("decode", 4)
    assert graphs.load_inputs(seqs, ("decode", 4)) == slice(0, 3)  # row b is sequence b
    assert graphs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert graphs.positions[:4].tolist() == [5, 0, 8, 0]
    # Slot = block_table[pos // block_size] * block_size + pos % block_size; a padding lane writes nowhere.
    assert graphs.slot_mapping[:4].tolist() == [9 * 4 + 1, 4 * 4 + 0, 6 * 4 + 0, -1]
    assert graphs.seq_lens[:4].tolist() == [6, 1, 9, 0]  # a padding lane reads no key
    assert graphs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]  # one row a lane
    assert graphs.block_tables[:3, :3].tolist() == [[3, 9, 0], [4, 0, 0], [1, 2, 6]]
    # The same batch, built the eager way, agrees on every field the kernels read.
    built = ForwardBatch.build(seqs, 4)
    assert torch.equal(graphs.slot_mapping[:3], built.slot_mapping)
    assert torch.equal(graphs.positions[:3], built.positions)
    # A shorter step leaves older columns in place (never read) but re-pads its own lanes.
    graphs.load_inputs(seqs[1:2], ("decode", 1))
    assert graphs.seq_lens[:1].tolist() == [1] and graphs.slot_mapping[:1].tolist() == [16]
    with pytest.raises(ValueError, match="does not cover"):
        graphs.load_inputs([SeqSlice([1], 4, [3])], ("decode", 1))


def test_a_mixed_step_fills_the_static_buffers_and_pads_rows_and_lanes():
    _, graphs = _graphs(tiny_llama(1), max_num_seqs=3)
    seqs = [SeqSlice([7, 8, 9], 2, [3, 9]), SeqSlice([5], 4, [4, 1])]
    assert graphs.lookup(seqs) == ("mixed", 64)
    last = graphs.load_inputs(seqs, ("mixed", 64))
    assert graphs.input_ids[:5].tolist() == [7, 8, 9, 5, 0]
    assert graphs.positions[:5].tolist() == [2, 3, 4, 4, 0]
    # Slot = block_table[pos // 4] * 4 + pos % 4; padding rows write nowhere.
    assert graphs.slot_mapping[:5].tolist() == [3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 1 * 4 + 0, -1]
    assert (graphs.slot_mapping[4:64] == -1).all()
    assert graphs.seq_lens[:3].tolist() == [5, 5, 0]  # the spare lane reads no key
    assert graphs.query_start_loc[:4].tolist() == [0, 3, 4, 4]  # and owns no row
    assert graphs.block_tables[:2, :2].tolist() == [[3, 9], [4, 1]]
    assert last.tolist() == [2, 3]  # each sequence's last row: where its logits come from
    with pytest.raises(ValueError, match="does not cover position 5"):
        graphs.load_inputs([SeqSlice([1, 2], 4, [0])], ("mixed", 64))


def test_the_graph_a_step_takes_and_the_steps_no_graph_serves():
    _, graphs = _graphs(tiny_llama(1), max_num_seqs=2, max_tokens=64)
    one = SeqSlice([1], 0, [0])
    assert graphs.lookup([one, SeqSlice([2], 0, [1])]) == ("decode", 2)
    assert graphs.lookup([SeqSlice([1, 2], 0, [0])]) == ("mixed", 64)  # a prefill is a mixed step
    assert graphs.lookup([SeqSlice([1] * 40, 0, list(range(10))), SeqSlice([2], 3, [11])]) == ("mixed", 64)
    assert graphs.lookup([SeqSlice([1] * 65, 0, list(range(17)))]) is None  # more tokens than the largest bucket
    assert graphs.lookup([one] * 3) is None  # more sequences than the graphs hold
    with pytest.raises(ValueError, match="no graph serves this step"):
        graphs.run([one] * 3)


def test_looking_a_step_up_changes_nothing():
    """The lookup is a question, not an action: no graph is recorded, no buffer written, no step counted."""
    _, graphs = _graphs(tiny_llama(1))
    before = (graphs.tokens.clone(), graphs.lanes.clone(), graphs.block_tables.clone())
    for step in ([SeqSlice([1], 3, [0])], [SeqSlice([1, 2, 3], 0, [2])], [SeqSlice([4], 0, [0])] * 9):
        graphs.lookup(step)
    assert graphs.graphs == {} and sum(graphs.replays.values()) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (graphs.tokens, graphs.lanes, graphs.block_tables)))


def test_graphs_are_refused_where_they_cannot_run():
    model = tiny_llama(1)
    runner = ModelRunner(model, 8, 4, backend="paged-torch")
    assert runner.graphs is None and runner.graph_steps == 0  # on a CPU the default is eager
    with pytest.raises(ValueError, match="cannot be captured"):
        StepGraphs(model, runner.kv_store, "paged-torch", 4, 64, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraphs(model, runner.kv_store, "triton", 4, 64, capture=True)
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        ModelRunner(model, 8, 4, backend="triton", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs='capture'"):
        ModelRunner(model, 8, 4, backend="triton", cuda_graphs="capture")
    with pytest.raises(ValueError, match="cuda_graphs='eager'.*paged-torch"):
        ModelRunner(model, 8, 4, backend="paged-torch", cuda_graphs="eager")
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        Engine(model, 8, 4, backend="triton", cuda_graphs="yes")
    with pytest.raises(TypeError, match="cuda_graphs"):
        Engine(model, 8, 4, backend="triton", cuda_graphs=1)
    assert ModelRunner(model, 8, 4, backend="triton", cuda_graphs="eager").graph_mode == "eager"


def _serve(model, graphs: str, **engine):
    """Serve a workload whose decode batches shrink as requests finish (3 of 4 lanes, 2 of 2, ...) and
    whose prompts arrive while others decode: decode-only steps, mixed steps and prefill-only steps."""
    prompts = [[1, 5, 9, 13, 2, 6], [3, 7], [11] * 19, [4, 8, 12], [9, 9, 9, 9, 9, 9, 9, 9, 9]]
    params = [kvcourse.SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (9, 4, 7, 12, 2)]
    eng = Engine(model, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, backend="triton",
                 cuda_graphs={"captured": "capture", "static": "eager", "off": "off"}[graphs], **engine)  # fmt: skip
    return eng.generate(prompts, params), eng


@padding_nan
@pytest.mark.parametrize("seed", [0, 1])
def test_every_step_from_a_graph_gives_the_eager_tokens(seed, kernels_on):
    """fp32, token for token: on a CPU the static forward (what a graph records) run eagerly, on a GPU the
    graphs recorded at start-up replayed. Every step of the workload is served from a graph, of both kinds."""
    device = kernels_on
    model = tiny_llama(seed).to(device)  # head_dim 8: the kernels pad it to tl.dot's 16 (head_tile)
    eager, _ = _serve(model, "off")
    got, eng = _serve(model, "captured" if device.type == "cuda" else "static")
    assert got == eager
    graphs = eng.runner.graphs
    assert eng.runner.graph_steps == len(eng.events)  # every step
    assert graphs.replays["decode"] > 0 and graphs.replays["mixed"] > 0  # of both kinds
    if device.type == "cuda":  # every graph recorded when the engine started
        assert set(graphs.graphs) == set(graphs.keys())


@kernels_on_cpu
@padding_nan
def test_the_graph_path_with_prefix_caching_gives_the_eager_tokens():
    model = tiny_llama(3)
    eager, _ = _serve(model, "off", enable_prefix_caching=True)
    got, eng = _serve(model, "static", enable_prefix_caching=True)
    assert got == eager and eng.runner.graphs.replays["decode"] > 0 and eng.runner.graphs.replays["mixed"] > 0


@pytest.mark.parametrize("backend", ["paged-torch", "triton"])
def test_a_forward_never_waits_for_the_device(backend):
    """Inside ``forward_batch`` nothing reads a value back (on a GPU each would be a synchronisation):
    the batch carries host copies of everything a decision needs. Mixed and decode-only steps alike."""
    if backend == "triton" and kernel_device().type != "cpu":
        pytest.skip("Triton kernels take cuda tensors in this process, not cpu ones")
    model = tiny_llama(2)
    runner = ModelRunner(model, 32, 4, backend=backend, cuda_graphs=False)
    forward_batch = model.forward_batch

    def labelled(*args, **kwargs):
        with torch.profiler.record_function("forward_batch"):
            return forward_batch(*args, **kwargs)

    model.forward_batch = labelled
    runner.step([(0, [1, 2, 3, 4, 5, 6]), (1, [7, 8, 9])])
    mixed = [(0, [10]), (1, [11]), (2, [12, 13, 14, 15, 16])]
    assert sync_ops(lambda: runner.step(mixed), within="forward_batch") == {}
    decode = [(0, [17]), (1, [18]), (2, [19])]
    assert sync_ops(lambda: runner.step(decode), within="forward_batch") == {}
    # The count is not blind: the host-side build of the batch (CPU tensors) does read values.
    assert sync_ops(lambda: runner.step([(0, [20])])) != {}


@kernels_on_cpu
def test_the_static_forward_never_waits_for_the_device():
    model = tiny_llama(2)
    runner, graphs = _graphs(model)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    for seq_id in (0, 1):
        runner.block_manager.append_slots(seq_id, 1)
    table = runner.block_manager.block_table
    graphs.load_inputs([SeqSlice([8], 5, table(0)), SeqSlice([9], 2, table(1))], ("decode", 2))
    assert sync_ops(lambda: graphs.forward(("decode", 2))) == {}


@kernels_on_cpu
def test_the_static_forward_copies_nothing_from_the_host(monkeypatch):
    """A copy from pageable host memory is not allowed while a CUDA graph records: the forward a graph
    records must not make a tensor out of Python data (the SDPA backend's decode masks did, once)."""
    model = tiny_llama(5)
    runner, graphs = _graphs(model)
    runner.step([(0, [1, 2, 3]), (1, [4, 5, 6, 7, 8])])
    graphs.forward(("decode", 2))  # once first, as capture_graph warms up: caches fill here

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor made from host data inside the captured forward")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    graphs.forward(("decode", 2))


def test_a_hand_made_batch_with_a_bad_token_is_still_refused_by_name():
    model = tiny_llama(1)
    runner = ModelRunner(model, 8, 4)
    runner.block_manager.allocate(0, 0)
    start = kvcourse.paged.allocate_slots(runner.block_manager, runner.kv_store, 0, 2)
    good = ForwardBatch.build([SeqSlice([1, 2], start, runner.block_manager.block_table(0))], 4)
    bad = ForwardBatch(input_ids=torch.tensor([1, 500]), positions=good.positions, slot_mapping=good.slot_mapping,
                       query_start_loc=good.query_start_loc, seq_lens=good.seq_lens, block_tables=good.block_tables,
                       block_size=4)  # fmt: skip
    assert bad.token_range_host == (1, 500)
    with pytest.raises(ValueError, match=r"batch.input_ids has token ids outside the vocabulary.*500"):
        model.forward_batch(bad, runner.kv_store)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_decode_of_the_real_model_equals_eager_cuda(model, tok):
    """The real model, fp32, on the GPU: the captured engine's tokens are the eager engine's, and a
    replayed step never synchronises (torch's sync debug mode raises on any synchronising call)."""
    model_on = real_model_on(model, torch.device("cuda"))
    prompts = [tok.encode(p) for p in ("The capital of France is", "Once upon a time", "def fibonacci(n):")]
    params = [kvcourse.SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (24, 9, 17)]
    runs = {}
    for graphs in (False, True):
        eng = Engine(model_on, num_blocks=64, block_size=16, max_num_seqs=8, backend="triton", cuda_graphs=graphs)
        runs[graphs] = (eng.generate(prompts, params), eng.runner.graph_steps)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0 and runs[False][1] == 0
    runner = ModelRunner(model_on, 16, 16, backend="triton", cuda_graphs=True, max_num_seqs=4)
    runner.step([(0, prompts[0]), (1, prompts[1])])
    runner.step([(0, [5]), (1, [6])])  # bucket 2, recorded when the runner was made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.step([(0, [7]), (1, [8])])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, model_on.config.vocab_size) and runner.graphs.replays["decode"] == 2


@kernels_on_cpu
@padding_nan
def test_after_a_kernel_fell_back_steps_run_the_ordinary_eager_path():
    """A kernel that falls back to torch reads the static batch's host copies, which describe the graph
    (contexts of the whole context length), not the step: from then on, no step goes through the graphs."""
    model = tiny_llama(4)
    eager, _ = _serve(model, "off")
    eng = Engine(model, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, backend="triton",
                 cuda_graphs="eager")  # fmt: skip
    eng.runner.graphs.fell_back = True
    one, prompt = SeqSlice([1], 0, [0]), SeqSlice([1, 2], 0, [0])
    assert eng.runner.graphs.lookup([one]) is None and eng.runner.graphs.lookup([prompt]) is None
    with pytest.raises(ValueError, match="fell back: True"):
        eng.runner.graphs.run([one])
    prompts = [[1, 5, 9, 13, 2, 6], [3, 7], [11] * 19, [4, 8, 12], [9, 9, 9, 9, 9, 9, 9, 9, 9]]
    params = [kvcourse.SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (9, 4, 7, 12, 2)]
    assert eng.generate(prompts, params) == eager and eng.runner.graph_steps == 0


@kernels_on_cpu
def test_the_static_mixed_forward_neither_waits_nor_copies_from_the_host(monkeypatch):
    model = tiny_llama(2)
    runner, graphs = _graphs(model, max_num_seqs=3)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    runner.block_manager.append_slots(0, 1)
    runner.block_manager.allocate(2, 0)
    start = kvcourse.paged.allocate_slots(runner.block_manager, runner.kv_store, 2, 3)
    table = runner.block_manager.block_table
    graphs.load_inputs([SeqSlice([8], 5, table(0)), SeqSlice([9, 10, 11], start, table(2))], ("mixed", 64))
    assert sync_ops(lambda: graphs.forward(("mixed", 64))) == {}

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor made from host data inside the recorded forward")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    graphs.forward(("mixed", 64))


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
    runner = ModelRunner(
        model_on, 16, 16, backend="triton", cuda_graphs=True, max_num_seqs=4, max_num_batched_tokens=64
    )
    runner.step([(0, prompts[0])])  # a prompt alone is a mixed step too
    runner.step([(0, [5]), (1, prompts[1])])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.step([(0, [7]), (2, prompts[2][:20])])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, model_on.config.vocab_size) and runner.graphs.replays["mixed"] == 3


@kernels_on_cpu
def test_static_buffers_are_loaded_from_host_tensors_made_on_the_cpu_on_purpose():
    """With torch's default device set to meta, loading a step of either kind still works: its host tensors say
    ``device="cpu"`` rather than following the default (they did not, once)."""
    model = tiny_llama(6)
    runner, graphs = _graphs(model)
    runner.step([(0, [1, 2, 3, 4, 5])])
    runner.block_manager.append_slots(0, 1)
    step = [SeqSlice([7], 5, runner.block_manager.block_table(0))]
    torch.set_default_device("meta")
    try:
        graphs.load_inputs(step, ("mixed", 64))
        assert graphs.input_ids[0].item() == 7
        graphs.load_inputs(step, ("decode", 1))
    finally:
        torch.set_default_device(None)
    assert graphs.input_ids[0].item() == 7


@kernels_on_cpu
def test_a_decode_graph_splits_from_the_steps_real_lengths(monkeypatch):
    """Issue 50: the decode forward reads a split plan filled from the step's own lengths, not the graph's
    "up to the context length"; the recording sees an empty plan, as it sees padding."""
    import kvcourse.backends.triton as triton_backend

    model = tiny_llama(2)
    runner, graphs = _graphs(model)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    for seq_id in (0, 1):
        runner.block_manager.append_slots(seq_id, 1)
    table = runner.block_manager.block_table
    graphs.load_inputs([SeqSlice([8], 5, table(0)), SeqSlice([9], 2, table(1))], ("decode", 2))
    plan = graphs.split_plan
    assert plan.chunk > 0 and plan.seqs[:2, 1].tolist() == [1, 1]  # one chunk each: no GPU, nothing to split
    assert graphs.static_batch(("decode", 2)).split_plan is plan
    assert graphs.static_batch(("mixed", 64)).split_plan is None  # the ragged kernel plans nothing
    planned = []
    real = triton_backend.rope_cache_decode  # a decode step's attention: one kernel a layer, reading the plan
    monkeypatch.setattr(triton_backend, "rope_cache_decode", lambda *a, **k: planned.append(a[8]) or real(*a, **k))
    graphs.forward(("decode", 2))
    assert planned == [plan] * model.config.num_hidden_layers  # every layer's decode read the plan
    graphs.load_padding(("decode", 2))
    assert plan.chunk == 0  # what a graph is recorded on
