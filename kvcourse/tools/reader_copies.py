"""Reader copies of chapter notebooks: they read cleanly on Colab, in JupyterLab and on GitHub.

Usage: ``python -m kvcourse.tools.reader_copies book/NN_x.ipynb ... --out DIR [--ref REF]``

The book renders two MyST features that Jupyter, Colab and GitHub show raw:

* ``{glue:text}`name``` roles, replaced here by the value the notebook glued. Values are read from the
  notebook's committed outputs (myst-nb's ``application/papermill.record/...`` bundles); nothing is
  re-executed. A format spec (``{glue:text}`name:.2f```) is applied as myst-nb applies it.
* directives: ``{exercise}`` becomes a bold "Exercise N.k: title" paragraph, numbered per chapter as the
  book numbers it; ``{solution}`` becomes a quoted "Solution to Exercise N.k" block; admonitions
  (``{note}``, ``{tip}``, ``{admonition} Title``, ...) become quoted blocks with a bold title, and so does
  sphinx-design's ``{dropdown} Title`` (a prediction's reasoning, hidden in the book until clicked): a
  notebook has no folding markdown, so the copy shows it open under its title.

Anything else MyST-only (another role or directive) is an error naming the notebook, so a new one gets
a rendering here instead of reaching a reader raw. ``--ref`` pins the Colab setup cell to a commit
(the one the site was built from). Code cells and outputs are copied unchanged.
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
from pathlib import Path

from ..instructor.notebook import cell_source

GLUE_PREFIX = "application/papermill.record/"
ADMONITIONS = {
    "note": "Note",
    "tip": "Tip",
    "hint": "Hint",
    "important": "Important",
    "warning": "Warning",
    "caution": "Caution",
    "attention": "Attention",
    "danger": "Danger",
    "error": "Error",
    "seealso": "See also",
}
# A role: {name}`content` (content has no backtick).
_ROLE = re.compile(r"\{(?P<name>[a-z][a-z0-9:_-]*)\}`(?P<content>[^`]*)`")
# The opening line of a directive fence: ```{name} args  or  :::{name} args
_INLINE = re.compile(_ROLE.pattern + r"|``.+?``|`[^`]+`")
_DIRECTIVE = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[a-z][a-z0-9:_-]*)\}[ \t]*(?P<args>.*)$")
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})")


def glue_values(nb: dict) -> dict[str, dict]:
    """name -> mime bundle (without the papermill prefix) for every value the notebook glued."""
    values = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            meta = out.get("metadata", {}).get("scrapbook")
            if not meta:
                continue
            prefix = meta.get("mime_prefix", GLUE_PREFIX)
            values[meta["name"]] = {k[len(prefix) :]: v for k, v in out.get("data", {}).items() if k.startswith(prefix)}
    return values


def format_plain_text(text: str, fmt_spec: str) -> str:
    """myst-nb's rendering of a text/plain glue value: Python literals lose their quotes, then format()."""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if not fmt_spec:
        return str(value)
    kind = fmt_spec[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, fmt_spec)


class ReaderCopyError(ValueError):
    pass


class _Renderer:
    def __init__(self, name: str, chapter: int | None, glue: dict[str, dict]):
        self.name, self.chapter, self.glue = name, chapter, glue
        self.exercises: dict[str, str] = {}  # label -> "N.k"

    def number(self) -> str:
        k = len(self.exercises) + 1
        return f"{self.chapter}.{k}" if self.chapter is not None else str(k)

    def role(self, m: re.Match) -> str:
        name, content = m["name"], m["content"]
        if name in ("glue", "glue:text", "glue:any", "glue:md"):
            # As myst-nb reads it: the last ":" starts a format spec (glue:text only).
            key, fmt = content.rsplit(":", 1) if name == "glue:text" and ":" in content else (content, "")
            bundle = self.glue.get(key)
            if bundle is None:
                raise ReaderCopyError(f"{self.name}: {{{name}}}`{content}` quotes a value the notebook never glued")
            if name == "glue:md" and "text/markdown" in bundle:
                return bundle["text/markdown"]
            if "text/plain" not in bundle:
                raise ReaderCopyError(f"{self.name}: glued value {key!r} has no text/plain form")
            return format_plain_text(bundle["text/plain"], fmt)
        if name == "math":
            return f"${content}$"
        if name in ("ref", "doc", "numref", "term"):  # `text <target>` -> text
            return re.sub(r"\s*<[^>]*>$", "", content)
        raise ReaderCopyError(f"{self.name}: no plain-markdown rendering for the role {{{name}}}")

    def inline(self, text: str) -> str:
        # Scanning left to right, a code span is copied as written (it may quote a role as code).
        def sub(m: re.Match) -> str:
            return self.role(m) if m["name"] else m[0]

        return _INLINE.sub(sub, text)

    def directive(self, name: str, args: str, body: list[str]) -> list[str]:
        options = {}
        while body and re.match(r"^:[a-z-]+:", body[0]):
            key, _, value = body.pop(0)[1:].partition(":")
            options[key] = value.strip()
        while body and not body[0].strip():
            body.pop(0)
        inner = self.lines(body)
        if name in ("exercise", "exercise-start"):
            number = self.number()
            self.exercises[options.get("label", f"#{number}")] = number
            title = f"**Exercise {number}" + (f": {self.inline(args)}**" if args else "**")
            return [title, "", *inner]
        if name in ("solution", "solution-start"):
            number = self.exercises.get(args.strip())
            if number is None:
                raise ReaderCopyError(f"{self.name}: solution for {args.strip()!r} comes before its exercise")
            return _quote([f"**Solution to Exercise {number}**", "", *inner])
        if name in ADMONITIONS or name in ("admonition", "dropdown"):
            title = self.inline(args) if name in ("admonition", "dropdown") else ADMONITIONS[name]
            return _quote([f"**{title}**", "", *inner])
        raise ReaderCopyError(f"{self.name}: no plain-markdown rendering for the directive {{{name}}}")

    def lines(self, lines: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(lines):
            line = lines[i]
            d = _DIRECTIVE.match(line)
            if d:
                end = _closing(lines, i + 1, d["fence"])
                if end is None:
                    raise ReaderCopyError(f"{self.name}: the {{{d['name']}}} directive is never closed")
                out += self.directive(d["name"], d["args"].strip(), lines[i + 1 : end])
                i = end + 1
                continue
            f = _FENCE.match(line)
            if f:  # a plain code block: copied as it is
                end = _closing(lines, i + 1, f["fence"])
                end = len(lines) - 1 if end is None else end
                out += lines[i : end + 1]
                i = end + 1
                continue
            out.append(self.inline(line))
            i += 1
        return out


def _closing(lines: list[str], start: int, fence: str) -> int | None:
    for j in range(start, len(lines)):
        s = lines[j].strip()
        if s and set(s) == {fence[0]} and len(s) >= len(fence):
            return j
    return None


def _quote(lines: list[str]) -> list[str]:
    return [f"> {x}" if x else ">" for x in lines]


def render_markdown(source: str, renderer: _Renderer) -> str:
    return "\n".join(renderer.lines(source.split("\n")))


def reader_copy(nb: dict, name: str, ref: str | None = None, cfg=None, glue: dict | None = None) -> dict:
    """Return the reader copy of ``nb`` (file name ``name``, e.g. ``02_kv_cache.ipynb``); ``nb`` is unchanged.

    ``glue`` (from :func:`glue_values` of the executed chapter) supplies the quoted numbers when ``nb``
    has no outputs of its own, as a student copy does.
    """
    from kvcourse.tools.book_config import chapter_number
    from kvcourse.tools.sync_notebooks import SETUP_MARKER, setup_source

    nb = copy.deepcopy(nb)
    try:
        chapter = chapter_number(Path(name))
    except ValueError:
        chapter = None
    renderer = _Renderer(name, chapter, glue_values(nb) if glue is None else glue)
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        source = cell_source(cell)
        before = len(renderer.exercises)
        cell["source"] = render_markdown(source, renderer)
        stated = list(renderer.exercises)[before:]
        if stated:  # the label leaves the text: keep it where the grader finds it (kvcourse.instructor.notebook)
            cell.setdefault("metadata", {})["exercise"] = stated[-1]
    if ref is not None and cfg is not None and chapter is not None:
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        if code and SETUP_MARKER in "".join(code[0]["source"]):
            code[0]["source"] = setup_source(cfg, cfg.chapter(Path(name)), ref)
    return nb


def _current_commit(root: Path) -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    import nbformat

    from kvcourse.tools.book_config import ROOT, load
    from kvcourse.tools.sync_notebooks import dumps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the reader copies")
    parser.add_argument(
        "--ref", help="git ref the Colab setup cells install (default: this checkout's commit, else the release tag)"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    parser.add_argument(
        "--glue-from",
        type=Path,
        default=None,
        help="folder of the executed chapters whose glued numbers to quote (for copies without outputs)",
    )
    args = parser.parse_args(argv)
    cfg = load(args.root)
    ref = args.ref or _current_commit(args.root) or cfg.release_ref
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.notebooks:
        if not path.is_file() or path.suffix != ".ipynb":
            parser.error(f"not a notebook: {path}")
        nb = nbformat.read(path, as_version=4)
        glue = None
        if args.glue_from is not None:
            glue = glue_values(nbformat.read(args.glue_from / path.name, as_version=4))
        copy_ = reader_copy(nb, path.name, ref, cfg, glue)
        (args.out / path.name).write_text(dumps(copy_))
        print(f"{path} -> {args.out / path.name} (setup cell at {ref})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
