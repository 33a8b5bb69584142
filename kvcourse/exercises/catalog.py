"""Which check grades which exercise: the grader's own map, kept next to the checks.

A chapter's exercise cell ends by calling its check, e.g. ``ch01.check_causal_mask(causal_mask)``.
The grader must not take that call from a submission (a student can call any other check there), so
every exercise label is listed here with the check that grades it and the names the student's
solution must define, in the order the check takes them. ``tests/test_catalog.py`` proves that the
list matches the reference solution cells of every chapter, so it cannot drift from the book.

Besides the names, an entry says what the solution may rely on when it runs alone in the grader's
clean process (:mod:`kvcourse.instructor.sandbox`), on top of the chapter's ``import`` lines:

* ``uses``: exercises whose answers this one builds on (chapter 1's attention calls the learner's own
  ``causal_mask``); their cells run first.
* ``given``: objects the grader provides, ``model`` and ``tok`` (SmolLM2, as ``load_pretrained`` gives them).
* ``setup``: a few lines that recreate what the solution reads from the chapter's text cells
  (``P``, the prompt length in chapter 1), written here rather than re-running the chapter.
* ``references_in_cells``: the solution cell itself compares with the reference its check refuses as
  an answer (chapter 4's bug hunt runs ``BlockManager`` beside the buggy allocator), so the reference
  is taken away only after the cells ran, before the check calls the answer.

This module imports no check: the grader reads it in processes where the checks must not be loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODEL", "ExerciseSpec", "EXERCISES", "NOTEBOOKS", "spec_for"]

MODEL = "<model>"  # an argument of the check that is the real model, not a name the student defines


@dataclass(frozen=True)
class ExerciseSpec:
    """One exercise: its label, its check (``"ch01.check_causal_mask"``) and what the check is given."""

    label: str
    check: str
    args: tuple[str, ...]
    uses: tuple[str, ...] = ()
    given: tuple[str, ...] = ()
    setup: str = ""
    references_in_cells: bool = False

    @property
    def chapter(self) -> str:
        """``"ch01"``: the module in :mod:`kvcourse.exercises` that holds the check."""
        return self.check.split(".")[0]

    @property
    def answers(self) -> tuple[str, ...]:
        """The names the student's solution must define."""
        return tuple(a for a in self.args if a != MODEL)


# Chapter 1's prompt, as its text builds it: P and the first generated tokens feed the frozen-tensor cell.
_CH01_PROMPT = """\
cfg = model.config
L, Hq, Hkv, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
ids = tok.encode("The capital of France is")
P = len(ids)
full = ids + kvcourse.generate(model, ids, max_new_tokens=3, use_cache=False, eos_token_ids=())
"""

# Chapter 3's cards, from the cell that plots how many sequences fit: the fit exercise may read them.
# chapter 4's trace and pool, from its "A workload to serve" section
_CH04_TRACE = """\
MAX_LEN, POOL = 2048, 32 * 1024
trace = make_trace(1000, seed=0, max_len=MAX_LEN)
"""
_CH03_GPUS = """gpus = {
    "24 GB (RTX 4090, L4)": 24 * GB,
    "80 GB (A100, H100)": 80 * GB,
    "141 GB (H200)": 141 * GB,
}
"""

_SPECS = [
    # chapter 1
    ExerciseSpec(
        "ch01-ex-frozen",
        "ch01.check_frozen_positions",
        ("frozen_positions",),
        given=("model", "tok"),
        setup=_CH01_PROMPT,
    ),  # the solution goes on to run the function on the real model
    ExerciseSpec("ch01-ex-mask", "ch01.check_causal_mask", ("causal_mask",)),
    ExerciseSpec("ch01-ex-attention", "ch01.check_attention", ("attention",), uses=("ch01-ex-mask",)),
    ExerciseSpec(
        "ch01-ex-pairs",
        "ch01.check_naive_attention_pairs",
        ("naive_attention_pairs",),
        given=("tok",),
        setup='P = len(tok.encode("The capital of France is"))\n',
    ),
    ExerciseSpec("ch01-ex-predict", "ch01.check_predicted_naive_step", ("predict_naive_step_ms",)),
    # chapter 2
    ExerciseSpec("ch02-ex-positions", "ch02.check_new_positions", ("new_positions",)),
    ExerciseSpec("ch02-ex-update", "ch02.check_cache_update", ("PreallocatedKVCache", MODEL)),
    ExerciseSpec(
        "ch02-ex-bughunt",
        "ch02.check_chunked_prefill",
        ("prefill_in_chunks_fixed", MODEL),
        given=("model", "tok"),
        setup='prompt_ids = tok.encode("The capital of France is")\n',
    ),
    ExerciseSpec("ch02-ex-decode", "ch02.check_decode_attention", ("attend",)),
    ExerciseSpec("ch02-ex-outweigh", "ch02.check_tokens_to_outweigh", ("tokens_to_outweigh",)),
    ExerciseSpec("ch02-ex-predict", "ch02.check_predicted_generation", ("predict_generation_ms",)),
    # chapter 3
    ExerciseSpec("ch03-ex-per-token", "ch03.check_bytes_per_token", ("bytes_per_token",)),
    ExerciseSpec("ch03-ex-per-rank", "ch03.check_bytes_per_rank", ("bytes_per_rank",), uses=("ch03-ex-per-token",)),
    ExerciseSpec("ch03-ex-kivi", "ch03.check_quantized_bytes", ("quantized_bytes",)),
    ExerciseSpec(
        "ch03-ex-fit", "ch03.check_max_sequences", ("max_sequences",), uses=("ch03-ex-per-token",), setup=_CH03_GPUS
    ),
    # the solution checks its prediction with the calculator the check refuses as an answer
    ExerciseSpec(
        "ch03-ex-context",
        "ch03.check_max_context",
        ("max_context",),
        uses=("ch03-ex-per-token",),
        references_in_cells=True,
    ),
    # chapter 4
    ExerciseSpec("ch04-ex-slot-mapping", "ch04.check_slot_mapping", ("step_slot_mapping",)),
    ExerciseSpec("ch04-ex-bughunt", "ch04.check_block_manager", ("FixedBlockManager",), references_in_cells=True),
    ExerciseSpec("ch04-ex-parallel-sampling", "ch04.check_parallel_sampling_blocks", ("blocks_with_sharing",)),
    ExerciseSpec("ch04-ex-block-size", "ch04.check_live_fraction", ("live_fraction",)),
    # the solution runs the simulator on the chapter's trace to compare with its prediction
    ExerciseSpec(
        "ch04-ex-reservation", "ch04.check_reservation_live", ("predict_reservation_live",), setup=_CH04_TRACE
    ),
    # chapter 5
    ExerciseSpec("ch05-ex-mask", "ch05.check_masked_decode", ("masked_decode_kernel_fixed",)),
    ExerciseSpec("ch05-ex-rescale", "ch05.check_online_softmax", ("online_decode_kernel_fixed",)),
    ExerciseSpec("ch05-ex-offset", "ch05.check_paged_offsets", ("paged_decode_kernel_fixed",)),
    ExerciseSpec("ch05-ex-merge", "ch05.check_merge_splits", ("merge_splits_kernel",)),
    ExerciseSpec("ch05-ex-tiled", "ch05.check_tiled_decode", ("tiled_decode_kernel",)),
    ExerciseSpec("ch05-ex-bytes", "ch05.check_kv_bytes", ("kv_bytes",)),
    ExerciseSpec("ch05-ex-predict", "ch05.check_int8_speedup", ("predict_speedup",)),
    # chapter 6
    ExerciseSpec("ch06-ex-running", "ch06.check_schedule_running", ("schedule_running",)),
    ExerciseSpec("ch06-ex-admission", "ch06.check_schedule_waiting", ("schedule_waiting",)),
    ExerciseSpec("ch06-ex-victims", "ch06.check_victims", ("pick_victim", MODEL)),
    ExerciseSpec("ch06-ex-chunk", "ch06.check_chunk_size", ("chunk_size",)),
    ExerciseSpec("ch06-ex-predict", "ch06.check_predicted_ttft", ("predict_ttft",)),
    # chapter 7
    ExerciseSpec("ch07-ex-hash-chain", "ch07.check_block_hashes", ("block_hashes",)),
    ExerciseSpec("ch07-ex-lru", "ch07.check_lru_takes", ("lru_takes",)),
    ExerciseSpec(
        "ch07-ex-lookup", "ch07.check_prefix_lookup", ("find_longest_cache_hit", MODEL), uses=("ch07-ex-hash-chain",)
    ),
    ExerciseSpec("ch07-ex-replay", "ch07.check_replay", ("replay",)),
    ExerciseSpec("ch07-ex-predict", "ch07.check_predicted_prefix_ttft", ("predict_ttft_ms",)),
    # chapter 8
    ExerciseSpec("ch08-ex-quantizer", "ch08.check_quantizer", ("quantize_dequantize",)),
    ExerciseSpec("ch08-ex-ring", "ch08.check_ring_slot", ("slot_for", MODEL)),
    ExerciseSpec("ch08-ex-snapkv", "ch08.check_snapkv_keep", ("snapkv_keep",)),
    ExerciseSpec("ch08-ex-absorb", "ch08.check_absorbed_decode", ("absorbed_decode",)),
    ExerciseSpec("ch08-ex-predict", "ch08.check_rounding_mse", ("predicted_mse",)),
    # chapter 9
    ExerciseSpec("ch09-ex-bytes", "ch09.check_step_bytes", ("step_bytes",)),
    ExerciseSpec("ch09-ex-floor", "ch09.check_gpu_floor", ("gpu_floor_ms",)),
    ExerciseSpec("ch09-ex-overlap", "ch09.check_overlap_gain", ("overlap_gain",)),
]

EXERCISES: dict[str, ExerciseSpec] = {spec.label: spec for spec in _SPECS}

# The book's notebook of each chapter: what the grader names a chapter nobody handed in.
NOTEBOOKS = {
    "ch01": "01_naive_generation.ipynb",
    "ch02": "02_kv_cache.ipynb",
    "ch03": "03_memory.ipynb",
    "ch04": "04_paged_kv_cache.ipynb",
    "ch05": "05_triton_kernels.ipynb",
    "ch06": "06_serving.ipynb",
    "ch07": "07_reusing_the_cache.ipynb",
    "ch08": "08_compressing_the_cache.ipynb",
    "ch09": "09_gpu_step.ipynb",
}


def spec_for(label: str) -> ExerciseSpec:
    """The entry for exercise ``label``; ``KeyError`` naming it if the catalog has none."""
    try:
        return EXERCISES[label]
    except KeyError:
        raise KeyError(f"no check is registered for exercise {label!r} in kvcourse.exercises.catalog") from None
