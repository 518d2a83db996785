"""What the documentation quotes agrees with what the repository holds: cited files exist, figures are
the measured ones, context sizes are the sidecars', example options exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CITING = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "bench").glob("*.md")),
          *sorted((ROOT / "bench" / "results").glob("*.md")), *sorted((ROOT / "hf_longctx").rglob("*.py")),
          *sorted((ROOT / "scripts").rglob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]


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
