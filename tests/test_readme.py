"""The README and docs/ run as written, and say only what is there.

- The README's tour: every ```python block, in order, as one script under ``mpirun -n 8``
  (what the README says), from the one-process run of the suite.
- Every page of docs/: its ```python blocks, in order, as one script of its own, in a fresh
  namespace and a directory of its own; all pages run one after another in one ``mpirun -n 8``
  job (the global contexts reset between pages), and each page's printed claims are checked.
- Every relative link in README.md and docs/*.md names an existing file, and, for a Markdown
  file, an existing heading; every page of docs/ is linked from the README.
- Every ``python -m simpar.X`` or ``benchmarks/X.py`` command quoted names an existing module or
  script and options that exist in its source.
- The README stays short (at most 250 lines).

    python -m pytest tests/test_readme.py -q
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import simpar.comm as comm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

# What a page's snippets print, the claims of their comments: (text, times over all 8 ranks).
PAGE_OUTPUT: dict[str, list[tuple[str, int]]] = {
    "training.md": [("fc1.weight slice (8, 16), Adam's m (8, 16)", 8),
                    ("recomputed: ['block0-TransformerBlock', 'block1-TransformerBlock']", 8),
                    ("chose level1, 0/2 Cells recomputed, 2 micro-batches", 8)],
    "programs.md": [
        ("1 fwd op-collective AllReduce group=[0, 1, 2, 3] recv=49152 B", 4),
        ("1 fwd op-collective AllReduce group=[4, 5, 6, 7] recv=49152 B", 4),
    ],
    "strategy-files.md": [("was written for device_num 8, but device_num is 4", 8)],
    "cost-model.md": [("whole program", 8)],
    "convnets.md": [("rank 5: holds (2, 4, 6, 6), AllReduce over [5, 7]", 1)],
    "pipeline.md": [("pipeline: the same losses and parameters as one device", 8),
                    ("stage 0, 17 parameters, tasks ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', "
                     "'B2', 'B3']", 4)],
}


def python_blocks(text: str) -> list[str]:
    """A page's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def pages_with_code() -> list[Path]:
    return [p for p in doc_pages() if python_blocks(p.read_text())]


def _mpirun_8(script: Path, cwd: Path, args: list[str] | None = None) -> str:
    """Run ``script`` under ``mpirun -n 8`` and return its output; fail on a non-zero exit."""
    bindir = str(Path(sys.executable).parent)
    mpirun = shutil.which("mpirun", path=bindir + os.pathsep + os.environ.get("PATH", ""))
    assert mpirun is not None, "no mpirun next to this Python nor on PATH"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "HYDRA_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([mpirun, "-n", "8", sys.executable, str(script), *(args or [])],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


# --- the README's tour ---------------------------------------------------------------------


def test_the_readme_has_a_tour() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4, "the tour lost snippets"
    assert any("check_against_single_device" in b for b in blocks)


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.slow
def test_every_readme_snippet_runs_under_mpirun_n_8(tmp_path: Path) -> None:
    if comm.get_group_size() != 1:
        pytest.skip("the one-process run starts its own mpirun -n 8")
    script = tmp_path / "tour.py"
    script.write_text("\n\n".join(python_blocks(README.read_text())))
    out = _mpirun_8(script, tmp_path)
    # Every rank printed the check's verdict, and it passed.
    assert out.count("check against one device (3 steps, every rank's shards)") == 8, out[-4000:]
    assert "FAIL" not in out and out.count(": PASS") == 8
    assert "AllToAll" in out  # the redistribution snippet's plan


# --- the pages of docs/ ----------------------------------------------------------------------

_DRIVER = '''\
"""Runs each page's script in a fresh namespace and a directory of its own, contexts reset."""
import os
import sys

import simpar
import simpar.comm
from simpar.cost import reset_cost_model_context

home = os.getcwd()
for script in sys.argv[1:]:
    name = os.path.basename(script)[:-3]
    print(f"== page {name} ==", flush=True)
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()
    os.chdir(os.path.join(home, name))
    with open(script) as f:
        code = compile(f.read(), f"docs/{name}.md", "exec")
    exec(code, {"__name__": "__main__"})
    os.chdir(home)
    simpar.comm.barrier()
    print(f"== done {name} ==", flush=True)
'''


def test_docs_pages_are_linked_from_the_readme() -> None:
    readme = README.read_text()
    missing = [p.name for p in doc_pages() if f"(docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README's map does not link: {missing}"


def test_docs_snippets_compile() -> None:
    assert len(pages_with_code()) >= 5, "docs/ lost its snippets"
    for page in pages_with_code():
        compile("\n\n".join(python_blocks(page.read_text())), str(page), "exec")


@pytest.mark.slow
def test_every_docs_snippet_runs_under_mpirun_n_8(tmp_path: Path) -> None:
    if comm.get_group_size() != 1:
        pytest.skip("the one-process run starts its own mpirun -n 8")
    pages = pages_with_code()
    scripts = []
    for page in pages:
        (tmp_path / page.stem).mkdir()
        scripts.append(tmp_path / f"{page.stem}.py")
        scripts[-1].write_text("\n\n".join(python_blocks(page.read_text())))
    driver = tmp_path / "run_pages.py"
    driver.write_text(_DRIVER)
    out = _mpirun_8(driver, tmp_path, [str(s) for s in scripts])
    assert "FAIL" not in out and "Traceback" not in out, out[-4000:]
    for page in pages:
        done = out.count(f"== done {page.stem} ==")
        assert done == 8, f"{page.name} finished on {done} of 8 ranks: {out[-4000:]}"
        for text, count in PAGE_OUTPUT.get(page.name, []):
            assert out.count(text) == count, f"{page.name} printed {text!r} {out.count(text)} times"


# --- links ---------------------------------------------------------------------------------


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (repeats get -1, -2, ... as on GitHub)."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_slug_matches_githubs() -> None:
    assert slug("The path data takes: trace → plan → lower → execute") == \
        "the-path-data-takes-trace--plan--lower--execute"
    assert slug("`AutoParallel`'s settings are scoped") == "autoparallels-settings-are-scoped"
    assert slug("MPICH wait policy: spin vs yield") == "mpich-wait-policy-spin-vs-yield"
    assert slug("adam_float32") == "adam_float32"


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


# --- quoted commands -------------------------------------------------------------------------


def _commands(text: str) -> list[str]:
    """Every quoted command line: inline code spans and the lines of ```bash blocks, with
    backslash continuations joined and whitespace collapsed."""
    bash = re.findall(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M)
    lines = [ln for b in bash for ln in b.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M))
    return [" ".join(c.split()) for c in lines + spans]


def _target(command: str) -> tuple[str, list[Path]] | None:
    """The module or script a command runs, and the sources its options may live in (the whole
    package: a module's options may sit in a module it imports)."""
    m = re.search(r"-m (simpar(?:\.\w+)*)", command)
    name = m.group(1) if m else "simpar.launch" if re.match(r"(\S*/)?simrun\b", command) else None
    if name is not None:
        rel = ROOT / Path(*name.split("."))
        assert rel.with_suffix(".py").exists() or (rel / "__init__.py").exists(), \
            f"{command!r}: no module {name}"
        return name, sorted((ROOT / "simpar").rglob("*.py"))
    b = re.search(r"benchmarks/(\w+)\.py", command)
    if b is not None:
        script = ROOT / "benchmarks" / f"{b.group(1)}.py"
        assert script.exists(), f"{command!r}: no script {script.name}"
        return str(script), sorted((ROOT / "benchmarks").glob("*.py"))
    return None


def _options(command: str) -> list[str]:
    """The --options of a command's first program (not of a command after ' -- ')."""
    own = command.split(" -- ", 1)[0]
    return [o.split("=", 1)[0] for o in re.findall(r"(?<!\S)--[a-z][\w-]*(?:=\S*)?", own)]


def test_quoted_commands_name_real_scripts_and_options() -> None:
    checked = 0
    sources: dict[Path, str] = {}
    for page in [README, *doc_pages()]:
        for command in _commands(page.read_text()):
            found = _target(command)
            if found is None:
                continue
            name, files = found
            text = "".join(sources.setdefault(f, f.read_text()) for f in files)
            for option in set(_options(command)) - {"--help"}:  # argparse's own
                positive = "--" + option[len("--no-"):] if option.startswith("--no-") else None
                assert f'"{option}"' in text or (positive and f'"{positive}"' in text), \
                    f"{page.name}: {command!r}: {name} has no option {option}"
            checked += 1
    assert checked >= 20, "fewer commands found than the pages quote"
