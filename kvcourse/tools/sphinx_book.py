"""A Sphinx extension for the book (``_config.yml``: ``sphinx.extra_extensions``).

* Exercises are numbered per chapter, "Exercise 4.1", "Exercise 4.2", ..., taken from the
  ``NN_`` prefix of the chapter's file name. sphinx-exercise numbers them across the whole book
  otherwise (chapter 4 would start at Exercise 12). The reader copies number them the same way.
* MathJax is served from the site itself (``_static/mathjax``, copied from the
  ``django-static-mathjax`` package, which holds MathJax 3's files and nothing of Django), so
  equations render without a CDN.
* Inline scripts registered twice (sphinx-thebe's, by Jupyter Book) are written once, and the theme
  gets a default colour mode: both otherwise put errors in a new reader's browser console.
* The playground (``_static/kvplay.js``, chapters 4, 6 and 7) gets Pyodide and the control plane's wheel
  under ``_static/playground`` (:mod:`kvcourse.tools.playground_site`); without Pyodide installed the book
  still builds, says so, and the widget tells the reader it was left out. Its script is linked from those three
  pages only, and each widget carries what its first click costs (``data-cost``: this build's bytes, and the
  committed throttled measurement, :func:`kvcourse.tools.playground_site.first_click_cost`), stated beside its
  button.
* Inline code gets a ``<wbr>`` after each ``.``, ``_``, ``(`` and ``/``: on a phone a long name breaks there and nowhere
  else (``_static/kvcourse.css`` forbids breaks inside a word).
* The font-awesome 4 stylesheet that matplotlib's animation HTML links from a CDN is dropped: the
  theme's own Font Awesome draws the animation's buttons (``fa fa-play`` ...).
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

from docutils import nodes

MATHJAX_DIR = "mathjax"  # under _static
_FA4_CDN = re.compile(r'<link[^>]*href="https://maxcdn\.bootstrapcdn\.com/font-awesome/[^"]*"[^>]*>\s*')


def _mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax package

    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (es5 / "tex-chtml.js").is_file():
        raise FileNotFoundError(f"MathJax 3 not found at {es5}: pip install django-static-mathjax")
    return es5


def _config_inited(app, config) -> None:
    _mathjax_source()  # fail early, before a build that would link a missing file
    config.mathjax_path = f"{MATHJAX_DIR}/tex-chtml.js"  # relative to _static
    # Without a default the theme logs "Got invalid theme mode" to the console of every new reader.
    config.html_context.setdefault("default_mode", "auto")


def _dedupe_scripts(app, pagename, templatename, context, doctree) -> None:
    """Jupyter Book registers sphinx-thebe's inline script twice; the second `const` is a SyntaxError."""
    seen, unique = set(), []
    for script in context.get("script_files", []):
        attributes = getattr(script, "attributes", {})
        key = (
            str(getattr(script, "filename", script) or ""),
            tuple(sorted((k, str(v)) for k, v in attributes.items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def _playground_only_where_it_plays(app, pagename, templatename, context, doctree) -> None:
    """``_static/kvplay.js`` goes to every page (Jupyter Book links every script in ``_static``); keep it on the
    pages that hold a widget (``<div class="kvplay">``, chapters 4, 6 and 7), so the others carry none of it.
    Those pages' widgets get ``data-cost``, what opening the playground downloads, for the text beside its button."""
    body = context.get("body", "")
    if 'class="kvplay"' in body:
        from .playground_site import first_click_cost

        cost = first_click_cost()
        if cost is not None:
            attribute = html.escape(json.dumps(cost, separators=(",", ":")), quote=True)
            context["body"] = body.replace('<div class="kvplay"', f'<div class="kvplay" data-cost="{attribute}"')
        return
    context["script_files"] = [
        s for s in context.get("script_files", []) if not str(getattr(s, "filename", s) or "").endswith("kvplay.js")
    ]


_INLINE_CODE = re.compile(r'(<code class="docutils literal notranslate">)(.*?)(</code>)', re.S)
_TAG_OR_TEXT = re.compile(r"(<[^>]*>)|([^<]+)")


def _break_points(match: re.Match) -> str:
    """One inline code span with ``<wbr>`` after each ``.``, ``_``, ``(`` and ``/`` (a path's) of its text (never inside
    a tag, never at its end; entities such as ``&lt;`` hold none of them). A piece between two of them that holds
    another character a browser breaks after (``-`` in ``--gpu-memory-utilization``) is kept whole in a
    ``kv-nobr`` span (``white-space: nowrap`` in ``_static/kvcourse.css``)."""

    def piece(text: str) -> str:
        return f'<span class="kv-nobr">{text}</span>' if re.search(r"[^\w.(/\s]", text) else text

    def text(part: re.Match) -> str:
        if part[1]:
            return part[1]
        return "<wbr>".join(piece(p) for p in re.split(r"(?<=[._(/])(?=\S)", part[2]))

    return match[1] + _TAG_OR_TEXT.sub(text, match[2]) + match[3]


def _break_inline_code_at_names(app, pagename, templatename, context, doctree) -> None:
    if "body" in context:
        context["body"] = _INLINE_CODE.sub(_break_points, context["body"])


def _copy_mathjax(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        shutil.copytree(_mathjax_source(), Path(app.outdir) / "_static" / MATHJAX_DIR, dirs_exist_ok=True)


def _copy_playground(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        from sphinx.util import logging

        from .playground_site import PYODIDE_VERSION, install, pyodide_dir

        manifest = install(Path(app.outdir) / "_static")
        if manifest is None:  # a note, not a warning: the book is whole without it
            logging.getLogger(__name__).info(
                f"kvcourse: no Pyodide at {pyodide_dir()}, so the playground is left out of this build "
                f"(npm install --prefix .venv/pyodide pyodide@{PYODIDE_VERSION})"
            )
        else:
            logging.getLogger(__name__).info(
                f"kvcourse: the playground adds {manifest['bytes'] / 1e6:.1f} MB, loaded on the reader's click"
            )


def _number_exercises_per_chapter(app, env) -> list[str]:
    """Runs after Sphinx numbered every exercise across the book; renumbers them (chapter, k)."""
    changed = []
    for docname, by_type in env.toc_fignumbers.items():
        numbers = by_type.get("exercise")
        if not numbers:
            continue
        m = re.match(r"(\d\d)_", Path(docname).name)
        prefix = (int(m[1]),) if m else ()
        ordered = sorted(numbers, key=lambda label: numbers[label])
        new = {label: prefix + (k,) for k, label in enumerate(ordered, start=1)}
        if new != numbers:
            by_type["exercise"] = new
            changed.append(docname)
    return changed


def _drop_cdn_stylesheet(app, doctree, docname) -> None:
    for node in doctree.findall(nodes.raw):
        if "html" in node.get("format", "") and "maxcdn.bootstrapcdn.com" in node.astext():
            text = _FA4_CDN.sub("", node.astext())
            node.replace_self(nodes.raw(text, text, format=node["format"]))


def setup(app):
    app.connect("config-inited", _config_inited)
    # After sphinx's own TocTreeCollector (priority 500) has assigned the book-wide numbers.
    app.connect("env-get-updated", _number_exercises_per_chapter, priority=900)
    app.connect("doctree-resolved", _drop_cdn_stylesheet)
    app.connect("html-page-context", _dedupe_scripts)
    app.connect("html-page-context", _playground_only_where_it_plays)
    app.connect("html-page-context", _break_inline_code_at_names)
    app.connect("build-finished", _copy_mathjax)
    app.connect("build-finished", _copy_playground)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
