"""Serving many requests at once (chapter 6), one file per job as nano-vllm lays it out.

* :mod:`.scheduler` -- :class:`Scheduler`: continuous batching under a token budget, chunked
  prefill, admission by free blocks with a watermark, preemption (of the newest request, or of a
  policy's choice) by recompute or by swap to host memory (chapter 7); prefix-cache hits at admission (chapter 7, on a
  :class:`~kvcourse.paged.PrefixCachingBlockManager`).
* :mod:`.model_runner` -- :class:`ModelRunner`: a scheduled step as one ``ForwardBatch`` and one forward,
  after the step's block moves between the device and host pools.
* :mod:`.engine` -- :class:`Engine`: ``generate``, ``add_request`` / ``step`` / ``abort``, ``stream``, ``stats``;
  its :class:`StepRecorder` writes the per-step event log and counters. A :class:`Request` (a prompt, its samples,
  its :class:`RequestMetrics`) lives beside its sequences in :mod:`kvcourse.sequence`.
* :mod:`.stats` -- :class:`StepEvent`, latency percentiles, ``Engine.stats``.
* :mod:`.load` -- open-loop load: Poisson arrivals on a modelled clock, SLO attainment, goodput,
  Little's law.
* :mod:`.baselines` -- one-at-a-time and static batching, to compare against.
* :mod:`.prefix_ttft` -- chapter 7's prediction of the time to first token with a prefix-cache hit.
* :mod:`.plots` -- the timeline of an event log.
"""

from ..lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it, imported when the name is first read
    "Engine": ".engine",
    "ModelRunner": ".model_runner",
    "Request": "..sequence",
    "RequestMetrics": "..sequence",
    "TokenOutput": "..sequence",
    "ScheduledSeq": ".scheduler",
    "Scheduler": ".scheduler",
    "SchedulerOutput": ".scheduler",
    "preempt_newest": ".scheduler",
    "StepEvent": ".stats",
    "StepRecorder": ".engine",
    "latency_summary": ".stats",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
