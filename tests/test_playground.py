"""The playground (issue 32): what the book's widget draws is what the real scheduler decided.

:class:`~kvcourse.control.playground.Playground` is checked against a plain loop over
:class:`~kvcourse.serving.Scheduler` written here, on the same workload; its pool view against the block
manager's own counts; each decision's line against the lines the step really ran; the chapter presets against
what the chapters' text says they show. The browser half (the widget, Pyodide, offline) is in
``tests/test_browser.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvcourse.control.playground import LINES, PRESETS, Playground, PlaygroundConfig, _workload, scheduler_source
from kvcourse.paged import BlockManager, PrefixCachingBlockManager
from kvcourse.sequence import SamplingParams, Sequence
from kvcourse.serving import Scheduler
from kvcourse.tools import playground_site

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    **PRESETS,
    "swap+prefix": PlaygroundConfig(num_blocks=12, token_budget=32, max_num_seqs=6, preemption="swap",
                                    prefix_caching=True, arrival="shared prompt", samples=2),
    "no chunking": PlaygroundConfig(num_blocks=16, token_budget=24, chunked_prefill=False, arrival="burst", seed=3),
    "one seat": PlaygroundConfig(max_num_seqs=1, samples=1, arrival="burst", seed=5),
}  # fmt: skip


def _reference(config: PlaygroundConfig) -> list[list]:
    """The same workload through the scheduler by hand: add on arrival, schedule, advance, fork at the first
    token (as the engine does), append placeholder tokens. What each step ran, admitted and preempted."""
    host = config.num_blocks // 2 if config.preemption == "swap" else 0
    cls = PrefixCachingBlockManager if config.prefix_caching else BlockManager
    bm = cls(config.num_blocks, config.block_size, num_host_blocks=host)
    sched = Scheduler(
        bm,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.token_budget,
        enable_chunked_prefill=config.chunked_prefill,
        watermark=0.0,
        preemption_mode=config.preemption,
    )
    arrivals = [
        (step, Sequence((i, 0), prompt, SamplingParams(max_new_tokens=new, stop_token_ids=(), n=config.samples)))
        for i, (step, prompt, new) in enumerate(_workload(config))
    ]
    steps, t = [], 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= t:
            sched.add(arrivals.pop(0)[1])
        out = sched.schedule()
        sched.advance(out)
        tokens = {}
        for s in out.scheduled:
            if s.samples:
                if s.seq.num_tokens == s.seq.num_prompt_tokens:
                    for k in range(1, s.seq.params.n):
                        child = s.seq.fork((s.seq.seq_id[0], k))
                        sched.fork(s.seq, child)
                        tokens[child.seq_id] = 0
                tokens[s.seq.seq_id] = 0
        sched.append_tokens(tokens)
        steps.append(
            [
                [(s.seq.seq_id, s.kind, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                [s.seq_id for s in out.admitted],
                [s.seq_id for s in out.preempted],
                bm.num_free_blocks,
            ]
        )
        t += 1
    return steps


def _name(seq_id) -> str:
    return f"r{seq_id[0]}" if seq_id[1] == 0 else f"r{seq_id[0]}.{seq_id[1]}"


@pytest.mark.parametrize("key", CONFIGS)
def test_the_playground_decides_as_the_scheduler_driven_by_hand(key):
    config = CONFIGS[key]
    records = Playground(config).run()
    reference = _reference(config)
    assert len(records) == len(reference)
    for r, (scheduled, admitted, preempted, free) in zip(records, reference):
        assert r["scheduled"] == [
            [_name(i), kind, c, n, r_s[4]] for (i, kind, c, n), r_s in zip(scheduled, r["scheduled"])
        ]
        assert [x[0] for x in r["scheduled"]] == [_name(i) for i, *_ in scheduled]
        said = " | ".join(d["text"] for d in r["decisions"])
        assert all(f"{_name(i)} admitted" in said for i in admitted), said
        assert all(f"{_name(i)} preempted" in said for i in preempted), said
        assert sum(kind == "free" or kind == "cached" for kind, _ in r["pool"]) == free
        assert r["budget"]["used"] == sum(n for *_, n in scheduled) <= config.token_budget


@pytest.mark.parametrize("key", CONFIGS)
def test_the_view_of_the_pool_is_the_block_managers(key):
    pg = Playground(CONFIGS[key])
    while not pg.done:
        r = pg.step()
        bm = pg.block_manager
        refs = [bm.ref_count(b) for b in range(bm.num_blocks)]
        assert [n for _, n in r["pool"]] == refs
        assert all((kind == "shared") == (n > 1) for kind, n in r["pool"])
        for name, table in r["tables"].items():
            for b in table:
                assert name in r["owners"][str(b)]
        held = sorted(b for table in r["tables"].values() for b in table)
        assert sorted(b for b, owners in r["owners"].items() for _ in owners) == sorted(map(str, held))
        assert r["host"].count("swapped") == sum(len(t) for t in r["host_tables"].values())
        assert set(r["running"]) | set(r["waiting"]) | set(r["swapped"]) == set(r["tables"])


@pytest.mark.parametrize("key", CONFIGS)
def test_every_decision_links_to_a_line_the_step_ran(key):
    source = {f["start"] + i: text for f in scheduler_source()["functions"] for i, text in enumerate(f["lines"])}
    for r in Playground(CONFIGS[key]).run():
        for d in r["decisions"]:
            if d["line"] is not None:  # a fork happens after schedule(), in the runner
                assert d["line"] in r["lines"], (r["step"], d)
                assert d["line"] in source, d  # the widget's source panel shows it
    assert set(LINES.values()) <= set(source)


def test_the_anchors_are_the_lines_they_name():
    lines = (ROOT / "kvcourse" / "serving" / "scheduler.py").read_text().splitlines()
    assert lines[LINES["admit"] - 1].strip() == "self._start(self.waiting.popleft(), out.admitted)"
    assert lines[LINES["recompute"] - 1].strip() == "self._recompute(seq)"
    assert len(set(LINES.values())) == len(LINES)
    linked = {d["line"] for c in CONFIGS.values() for r in Playground(c).run() for d in r["decisions"]}
    assert [key for key, line in LINES.items() if line not in linked] == []  # every anchor links some decision


def test_the_presets_show_what_the_chapters_say():
    """Chapter 4: a preemption when the pool runs dry. Chapter 6: chunks beside decodes, a preemption and a
    recompute, a request waiting with a named reason. Chapter 7: cache hits, shared blocks, cached blocks, a
    copy-on-write."""

    def texts(key):
        return [(r, d["text"]) for r in Playground(PRESETS[key]).run() for d in r["decisions"]]

    ch4 = texts("04")
    assert any("preempted" in t for _, t in ch4)
    ch6 = texts("06")
    chunk_steps = {r["step"] for r, t in ch6 if "chunk" in t}
    assert any(any("decodes" in t for r2, t in ch6 if r2["step"] == s) for s in chunk_steps)
    assert any("preempted" in t for _, t in ch6) and any("recomputes" in t for _, t in ch6)
    assert any(" waits: " in t for _, t in ch6)
    ch7 = Playground(PRESETS["07"]).run()
    assert sum(x[4] for r in ch7 for x in r["scheduled"]) > 0  # prefix-cache hits
    assert any(kind == "shared" for r in ch7 for kind, _ in r["pool"])
    assert any(kind == "cached" for r in ch7 for kind, _ in r["pool"])
    assert any(d["text"].startswith("copy-on-write") for r in ch7 for d in r["decisions"])


def test_the_playground_runs_without_torch_and_decides_the_same():
    code = """
import json
from kvcourse.control.playground import PRESETS, Playground
print(json.dumps({k: Playground(c).run() for k, c in PRESETS.items()}))
"""
    runs = []
    for prelude in (playground_site.REFUSE_DATA_PLANE, ""):
        proc = subprocess.run(
            [sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout))
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"num_blocks": "8"}, TypeError, "num_blocks"),
        ({"arrival": "poisson"}, ValueError, "arrival"),
        ({"preemption": "drop"}, ValueError, "preemption"),
        ({"prefix_caching": "yes"}, TypeError, "prefix_caching"),
        ({"samples": 9}, ValueError, "samples"),
    ],
)
def test_bad_settings_are_refused_by_name(change, error, match):
    with pytest.raises(error, match=match):
        replace(PlaygroundConfig(), **change)


def test_the_widgets_json_is_checked_too():
    with pytest.raises(ValueError, match=r"unknown playground settings \['chunk'\]"):
        PlaygroundConfig.from_json('{"chunk": 4}')
    assert PlaygroundConfig.from_json(json.dumps({"seed": 4})) == PlaygroundConfig(seed=4)
    with pytest.raises(TypeError, match="config must be a PlaygroundConfig"):
        Playground({"seed": 4})


def test_a_request_that_could_never_run_is_refused_before_step_0_by_name():
    with pytest.raises(ValueError, match=r"request r\d+ \(\d+ prompt tokens\) alone needs \d+ blocks"):
        Playground(PlaygroundConfig(num_blocks=2))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Playground(PlaygroundConfig(chunked_prefill=False, token_budget=4))


def test_a_finished_playground_says_so_and_changes_nothing():
    pg = Playground(PRESETS["04"])
    pg.run()
    before = pg.state()
    with pytest.raises(RuntimeError, match="reset it"):
        pg.step()
    assert pg.state() == before
    with pytest.raises(RuntimeError, match="max_steps=2"):
        Playground(PRESETS["06"]).run(max_steps=2)


def test_steps_do_not_leave_a_tracer_behind():
    previous = sys.gettrace()
    Playground(PRESETS["06"]).step()
    assert sys.gettrace() is previous


def test_the_wheel_holds_the_control_plane_and_nothing_else(tmp_path):
    files = playground_site.control_plane_files()
    assert "kvcourse/control/playground.py" in files and "kvcourse/serving/scheduler.py" in files
    assert not [f for f in files if re.search(r"model|kernels|kv_store|engine|runner|sampling", f)], files
    wheel = playground_site.build_wheel(tmp_path / "a")
    again = playground_site.build_wheel(tmp_path / "b")
    assert wheel.read_bytes() == again.read_bytes()  # the same sources give the same bytes
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = zf.read(next(n for n in names if n.endswith("RECORD"))).decode()
        for f in files:
            assert zf.read(f) == (ROOT / f).read_bytes()
    assert sorted(n for n in names if not n.startswith("kvcourse_control-")) == sorted(files)
    assert all(f in record for f in files)


def test_the_pyodide_version_is_named_once_for_make_and_the_site():
    makefile = (ROOT / "Makefile").read_text()
    assert f"PYODIDE_VERSION := {playground_site.PYODIDE_VERSION}" in makefile


def test_the_site_gets_nothing_without_pyodide(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_PYODIDE", str(tmp_path / "nowhere"))
    assert playground_site.install(tmp_path / "_static") is None
    assert not (tmp_path / "_static").exists()


def test_the_widget_asks_for_the_settings_the_playground_takes():
    """kvplay.js's form fields are PlaygroundConfig's fields, one for one (a renamed field would make every
    click an "unknown setting" error)."""
    js = (ROOT / "_static" / "kvplay.js").read_text()
    form = js[js.index("const FIELDS = [") : js.index("];", js.index("const FIELDS = ["))]
    fields = re.findall(r'^\s*\["(\w+)", "', form, flags=re.M)
    assert sorted(fields) == sorted(PlaygroundConfig.__dataclass_fields__)
    for chapter in ("04", "06", "07"):
        page = next((ROOT / "book").glob(f"{chapter}_*.ipynb")).read_text()
        assert f'class=\\"kvplay\\" data-preset=\\"{chapter}\\"' in page


@pytest.mark.parametrize("key", ["04", "swap+prefix"])
def test_before_the_first_step_the_widget_draws_an_empty_pool_and_every_request_to_come(key):
    """What the widget shows between "Open" and the first Step (issue 48): the pool all free, the host tier as
    big as swap mode makes it, every request not arrived yet; and the number of steps it says the run takes."""
    config = CONFIGS[key]
    from kvcourse.control.playground import count_steps, new

    state = json.loads(new(json.dumps(asdict(config))).state_json())
    assert [kind for kind, _ in state["pool"]] == ["free"] * config.num_blocks
    assert state["host"] == ["free"] * (config.num_blocks // 2 if config.preemption == "swap" else 0)
    assert state["not_arrived"] == [f"r{i}" for i in range(config.num_requests)]
    assert state["running"] == state["waiting"] == state["swapped"] == [] and state["tables"] == {}
    assert count_steps(json.dumps(asdict(config))) == len(Playground(config).run())
    with pytest.raises(ValueError, match="num_blocks"):
        count_steps(json.dumps({"num_blocks": 0}))
