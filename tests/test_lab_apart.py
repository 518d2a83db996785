"""The lab (research and benchmarks' machinery, ``hf_longctx/lab``) stands apart from the product.

(i) No module of the product imports ``hf_longctx.lab``, at the top or inside a function, absolutely or relatively.
(ii) The files of ``hf_longctx`` import one another without a cycle (function-local imports count), and never from a
lower layer up (kernels, layout, comm, data; backends and moe; hf; lab on top). Inside ``hf`` the rooms keep an order
too: ``settings`` imports no other room, ``memory`` and ``parallel`` import ``settings`` only, ``integration`` any of
them, and no room imports the ``hf`` package itself (docs/architecture.md, "Layers").
(iii) A CAD training step on 2 gloo processes, under every cost model a recipe accepts (FLOPs, a fitted grid file,
a fitted launch model file), leaves no ``hf_longctx.lab`` module imported: training never profiles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

PACKAGE = Path(__file__).resolve().parents[1] / "hf_longctx"
LAB = "hf_longctx.lab"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imported(module: str, path: Path, is_package: bool, modules) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file: ``import a.b``, ``from a import b`` (the
    submodule ``a.b`` where it is one, else ``a``), relative imports resolved against the module's package."""
    here = module.split(".") if is_package else module.split(".")[:-1]

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "hf_longctx"]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            if base.split(".")[0] != "hf_longctx":
                continue
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {m for m in map(known, names) if m and m != module}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def _in_lab(module: str) -> bool:
    return module == LAB or module.startswith(LAB + ".")


def test_the_graph_sees_relative_and_function_local_imports():
    """The parser the checks below rely on: a relative, a function-local and a ``from package import module``
    import are all edges."""
    graph = _graph()
    assert "hf_longctx.backends.cad.model_file" in graph["hf_longctx.backends.cad.runtime"]  # from .model_file
    assert "hf_longctx.kernels" in graph["hf_longctx.backends.cad.runtime"]  # from ...kernels inside a function
    assert "hf_longctx.lab.emulation.step_calls" in graph["hf_longctx.lab.cad.call_profile"]


def test_no_product_module_imports_the_lab():
    offenders = {m: sorted(filter(_in_lab, deps)) for m, deps in _graph().items()
                 if not _in_lab(m) and any(map(_in_lab, deps))}
    assert not offenders, f"the product imports the lab: {offenders}"


def test_no_product_module_names_the_emulated_group():
    """The comm layer and the backends reach an emulated group only through its comm ops (``comm.mode``): no module
    of the product names the emulation's types (an ``isinstance`` test, an attribute of its hub)."""
    named = {}
    for module, (path, _) in _modules().items():
        if _in_lab(module):
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        found = sorted(n for n in names if n in {"hub", "stage_on_host"} or n.startswith(("Emulated", "Emulation")))
        if found:
            named[module] = found
    assert not named, f"product modules name the emulation: {named}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_are_found_where_they_are():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_the_files_of_the_package():
    assert _cycles(_graph()) == []


# layers, lowest first: a module may import its own layer and those below, never one above
LAYERS = {"kernels": 0, "layout": 0, "comm": 0, "data": 0, "optional_triton": 0, "benchmarking": 0, "wrapping": 0,
          "backends": 1, "moe": 1, "hf": 2, "cli": 3, "": 3, "lab": 4}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def test_no_module_imports_a_layer_above_its_own():
    graph = _graph()
    assert set(LAYERS) - {""} >= {m.split(".")[1] for m in graph if "." in m}, "a new folder needs its layer"
    upward = [(m, d) for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, f"imports from a lower layer up: {upward}"


# the rooms of hf_longctx.hf, each with the rooms it may import besides its own
HF_ROOMS = {"settings": set(), "memory": {"settings"}, "parallel": {"settings"},
            "integration": {"settings", "memory", "parallel"}}


def _room(module: str) -> str | None:
    """The room of ``hf_longctx.hf`` a module belongs to (``hf_longctx.hf.memory.search`` -> ``memory``), or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "hf" else None


def test_every_module_of_hf_lives_in_a_room():
    modules = _modules()
    loose = sorted(m for m in modules if m.startswith("hf_longctx.hf.") and _room(m) not in HF_ROOMS)
    assert not loose, f"modules of hf outside its rooms (a new room needs its place in HF_ROOMS): {loose}"


def _against_the_rooms(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a room of hf imports a room it may not, or the hf package itself."""
    return [(m, d) for m, deps in sorted(graph.items()) if _room(m) for d in sorted(deps)
            if d == "hf_longctx.hf" or (_room(d) not in (None, _room(m)) and _room(d) not in HF_ROOMS[_room(m)])]


def test_the_room_check_finds_imports_against_the_order():
    graph = {"hf_longctx.hf.memory.plan": {"hf_longctx.hf.integration.callback", "hf_longctx.hf.settings.schema",
                                           "hf_longctx.hf.memory.enable", "hf_longctx.backends"},
             "hf_longctx.hf.parallel.fsdp": {"hf_longctx.hf.memory.model", "hf_longctx.hf"},
             "hf_longctx.hf.integration.callback": {"hf_longctx.hf.memory.enable", "hf_longctx.hf.parallel.fsdp"}}
    assert _against_the_rooms(graph) == [("hf_longctx.hf.memory.plan", "hf_longctx.hf.integration.callback"),
                                         ("hf_longctx.hf.parallel.fsdp", "hf_longctx.hf"),
                                         ("hf_longctx.hf.parallel.fsdp", "hf_longctx.hf.memory.model")]


def test_the_rooms_of_hf_import_only_the_rooms_below_them():
    upward = _against_the_rooms(_graph())
    assert not upward, f"imports between the rooms of hf against their order: {upward}"


def _train_cad_step(rank, world, options):
    """One optimizer step of a tiny Llama on ``longctx_cad`` with ``options`` (checked as a recipe's are), then no
    lab module may have been imported by anything the step ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_longctx  # noqa: F401 - registers the attention implementations
    from hf_longctx.hf import LongContextConfig, implementation_name
    from hf_longctx.hf.integration.inputs import install_input_hook
    from hf_longctx.layout import PackedBatch

    settings = LongContextConfig(backend="cad", backend_options=options)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation=implementation_name("cad"))).double()
    install_input_hook(model, group=None, options=settings.backend_options)
    packed = PackedBatch.from_doc_lens([9, 3, 14] if rank == 0 else [20, 5])
    ids = torch.randint(0, 61, (1, packed.num_tokens), generator=torch.Generator().manual_seed(rank))
    labels = ids.clone()
    labels[0, list(packed.doc_starts)] = -100
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=ids, position_ids=packed.position_ids[None], labels=labels).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    lab = sorted(m for m in sys.modules if _in_lab(m))
    assert not lab, f"a CAD training step with {options} imported the lab: {lab}"


def _grid_file(path: Path) -> str:
    from hf_longctx.backends.cad.cost_model import ProfiledCostModel

    ProfiledCostModel.from_grid((16, 64), (16, 64), [[1.0, 2.0], [3.0, 8.0]], interpolate="rate",
                                segment_cost=0.1).save(path, device="cpu", kernel="reference")
    return str(path)


def _launch_file(path: Path) -> str:
    from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms
    from hf_longctx.kernels.launch import LaunchGrid

    LaunchCostModel(LaunchGrid(slots=8), 4, PhaseTerms(3.5e-4, 4.2e-6, 7.3e-6, 0.0, 0.0, 0.0195),
                    PhaseTerms(1.02e-3, 1.84e-5, 1.55e-5, 1.49e-4, 1.5e-3, 0.0292)).save(
        path, device="cpu", kernel="reference")
    return str(path)


@pytest.mark.parametrize("cost_model", ["default", "flops", "grid file", "launch file"])
def test_a_cad_training_step_imports_no_lab_module(tmp_path, cost_model):
    options = {"default": {}, "flops": {"cost_model": "flops", "eps": 0.01},
               "grid file": {"cost_model": _grid_file(tmp_path / "grid.json")},
               "launch file": {"cost_model": _launch_file(tmp_path / "launch.json"), "cost_kernel": "reference"}}
    run_distributed(2, _train_cad_step, options[cost_model])
