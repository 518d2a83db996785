"""What the documentation quotes agrees with what the repository holds: cited files exist, figures are
the measured ones, context sizes are the sidecars', example options exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "recipes" / "README.md", ROOT / "scripts" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
CITING = [*DOCS, *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "bench" / "results").glob("*.md")),
          *sorted((ROOT / "hf_longctx").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py")),
          *sorted((ROOT / "examples").glob("*.py"))]


def test_every_cited_markdown_file_exists():
    present = {p.name for p in ROOT.rglob("*.md") if ".git" not in p.parts}
    missing = {(str(path.relative_to(ROOT)), name) for path in CITING
               for name in re.findall(r"(?<![\w.-])([\w][\w.-]*\.md)\b", path.read_text()) if name not in present}
    assert not missing, f"cited but not in the repository: {sorted(missing)}"


def test_the_results_index_links_every_results_file_and_every_bench_link_resolves():
    """bench/RESULTS.md is the index other documents cite: it names every dated file, and no link in bench/ is dead."""
    bench = ROOT / "bench"
    index = (bench / "RESULTS.md").read_text()
    results = sorted(path.name for path in (bench / "results").glob("*.md"))
    assert results, "bench/results/ holds no dated results file"
    assert not [name for name in results if f"](results/{name})" not in index], "RESULTS.md does not link them all"
    dead = [(str(path.relative_to(ROOT)), target) for path in [*bench.glob("*.md"), *(bench / "results").glob("*.md")]
            for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", path.read_text())
            if "://" not in target and not (path.parent / target).exists()]
    assert not dead, f"links to nothing: {dead}"


def _cad_fwd_bwd() -> dict[tuple[str, str], int]:
    """fwd+bwd TFLOP/s/GPU of the plain `cad` rows of the packed-mix table in bench/results/, by (mix, tokens)."""
    results = "\n".join(path.read_text() for path in sorted((ROOT / "bench" / "results").glob("*.md")))
    rows = re.findall(r"^\| (prolong|pretrain) \| (\d+K) \| cad \| \d+ \| (\d+) \|", results, re.M)
    return {(mix, tokens): int(value) for mix, tokens, value in rows}


def test_readme_quotes_cad_as_measured():
    cad = _cad_fwd_bwd()
    assert set(cad) == {("prolong", "256K"), ("prolong", "512K"), ("pretrain", "256K")}, cad
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| packed documents") and "longctx_cad" in line)
    low, high = min(cad.values()), max(cad.values())
    assert f"{low}-{high} TFLOP/s/GPU" in row, row
    assert (f"ProLong {cad['prolong', '256K']} / {cad['prolong', '512K']} at 256K / 512K, "
            f"Pretrain {cad['pretrain', '256K']} at 256K") in row, row


def test_readme_context_per_group_is_the_sidecars():
    """sp_size x seq_len of each GPU sidecar: what the README says a group holds on one node and on two."""
    per_group = {}
    for sidecar in (ROOT / "recipes").glob("*node-*gpu.longctx.yaml"):
        values = yaml.safe_load(sidecar.read_text())
        per_group.setdefault(sidecar.name.split("node")[0], set()).add(values["sp_size"] * values["seq_len"] // 1024)
    assert set(per_group) == {"1", "2"}, per_group
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"on GPUs, (\d+)K tokens per group on one node, (\d+)K per group on 2 nodes", readme)
    assert said, "the README no longer says what a GPU sidecar's group holds"
    assert ({int(said.group(1))}, {int(said.group(2))}) == (per_group["1"], per_group["2"]), per_group


def _example_args(name: str, argv: list[str]):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(argv)


def test_the_one_process_options_the_readme_names_exist():
    """2 processes equal one only at twice the per-process batch: the README names the options that say so."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`python examples/trainer_flattening.py --docs-per-step 8`" in readme
    assert "one process with `--rows-per-process 2`" in readme
    assert _example_args("trainer_flattening", ["--docs-per-step", "8"]).docs_per_step == 8
    assert _example_args("sft_trl", ["--rows-per-process", "2"]).rows_per_process == 2
    assert _example_args("sft_trl", []).rows_per_process == 1  # one row per process, as the README says


def test_the_readme_is_short_enough_for_its_readers():
    """The README is for users; architecture, CAD, memory and models live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, len(lines)
    for page in ("architecture.md", "cad.md", "memory.md", "models.md", "moe.md"):
        assert (ROOT / "docs" / page).is_file(), page
        assert f"docs/{page}" in "\n".join(lines), f"the README does not link docs/{page}"


_PATH = re.compile(r"`((?:scripts|hf_longctx|tests|recipes|examples|bench|data|docs)/[\w./-]*[\w/])`")
_NAME = re.compile(r"\bhf_longctx(?:\.\w+)+")


def _resolves(dotted: str) -> bool:
    """Whether ``hf_longctx.a.b.c`` is a module of the package or an attribute of one (modules that need an
    optional dependency, such as Triton, count by their file)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            break
    else:
        return False
    if cut == len(parts):
        return True
    obj = importlib.import_module(name)
    for attr in parts[cut:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_every_path_and_name_the_documents_cite_exists():
    """Files (`scripts/...`, `hf_longctx/...`, ...) and dotted names (`hf_longctx.x.y`) the documents cite are in
    the repository today: a moved script or a renamed function fails here, not in a reader's shell."""
    missing = []
    for doc in DOCS:
        text, where = doc.read_text(), str(doc.relative_to(ROOT))
        missing += [(where, path) for path in sorted(set(_PATH.findall(text))) if not (ROOT / path).exists()]
        missing += [(where, name) for name in sorted(set(_NAME.findall(text))) if not _resolves(name)]
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_model_counts_agree_with_the_lists():
    """The README's one line of sweep counts equals the counts of docs/models.md, they add up to the total, and
    the exact and no-interface lists hold as many names as they say."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"transformers ([\d.]+), (\d+) causal-LM classes: (\d+) exact, (\d+) refused by name, "
                     r"(\d+) without an attention interface, (\d+) not checked", readme)
    assert said, "the README no longer has its one line of model counts"
    version, total, exact, refused, no_interface, unchecked = said.groups()
    models = (ROOT / "docs" / "models.md").read_text()
    assert f"({total} in {version})" in models and f"With transformers {version}:" in models
    assert f"**exact ({exact})**" in models and f"**refused by name ({refused})**" in models
    assert f"**no attention interface ({no_interface})**" in models
    assert int(exact) + int(refused) + int(no_interface) + int(unchecked) == int(total)

    def listed(start: str, end: str) -> int:
        body = models[models.index(start) + len(start):models.index(end)]
        return len([name for name in body.replace("\n", " ").split(",") if name.strip()])

    assert listed(f"**exact ({exact})**:", "(*biogpt") == int(exact)
    assert listed(f"**no attention interface ({no_interface})**:", "run their own attention") == int(no_interface)
