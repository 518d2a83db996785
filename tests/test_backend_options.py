"""A call's ``options`` tune its backend; a key the backend does not read is refused, naming the closest one,
before any collective: ignored, a misspelt option would run another configuration than the one asked for."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.backends import get_backend, sequence_parallel_attention
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.layout import PackedBatch, shard_plan


def _call(backend: str, options: dict, world: int = 1):
    batch = PackedBatch.from_doc_lens([48, 16])
    plan = shard_plan(batch, world, get_backend(backend).default_strategy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    idx = plan.local_indices(0)
    return sequence_parallel_attention(q[idx], k[idx], v[idx], plan=plan, backend=backend, options=options, rank=0)


def test_a_misspelt_option_is_refused_with_the_name_it_resembles():
    with pytest.raises(ValueError, match=r"backend 'cad' has no option 'epss' \(did you mean 'eps'\?\); it takes eps"):
        _call("cad", {"epss": 0.01})
    with pytest.raises(ValueError, match=r"'pingpong_' \(did you mean 'pingpong'\?\)"):
        _call("cad", {"eps": 0.01, "pingpong_": False})


def test_an_option_for_another_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'ring' has no option 'eps'; it takes none"):
        _call("ring", {"eps": 0.01})


def test_the_options_a_backend_declares_are_taken():
    reference = _call("cad", {})
    tuned = _call("cad", {"eps": 0.01, "pingpong": False, "key_cuts": False, "refine_screen": 0})
    torch.testing.assert_close(tuned, reference)  # exact attention whatever the schedule


def test_the_emulation_refuses_them_too():
    batch = PackedBatch.from_doc_lens([48, 16])
    tensors = tuple(torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64) for _ in range(4))
    with pytest.raises(ValueError, match="backend 'cad' has no option 'eps_'"):
        emulate_step(batch, 2, tensors, "cad", options={"eps_": 0.01})



@pytest.mark.parametrize("options,problem", [
    ({"eps": -0.1}, "eps must be a number >= 0"),
    ({"eps": "tight"}, "eps must be a number >= 0 .* or 'auto', got 'tight'"),
    ({"cost_model": "profile"}, "cost_model must be 'flops' or the path of a fitted cost model file; no file at "
                                "'profile': make one with `hf-longctx-lab profile-cad --out FILE`"),
    ({"cost_model": "profiled"}, "cost_model 'profiled' is not measured inside training any more"),
    ({"cost_model": 3.0}, "cost_model must be 'flops', the path of a fitted cost model file or a cost model object"),
    ({"cost_kernel": "fa5"}, "cost_kernel must be 'auto' or one of"),
    ({"min_shard": 0}, "min_shard must be a whole number >= 1, got 0"),
    ({"search_width": 2.5}, "search_width must be a whole number >= 1"),
    ({"key_cuts": "no"}, "key_cuts must be true or false"),
    ({"refine_chains": "yes"}, "refine_chains must be true or false"),
    ({"pingpong": 1}, "pingpong must be true or false, got 1"),
    ({"refine_screen": -1}, "refine_screen must be a whole number"),
    ({"call_terms": "some"}, "call_terms must be a CallTerms, None or 'none'"),
    ({"tasks": [1, 2]}, "tasks must be a schedule's tasks"),
], ids=lambda x: f"{next(iter(x))}={x[next(iter(x))]}" if isinstance(x, dict) else None)
def test_a_value_the_backend_cannot_run_is_refused_before_it_schedules(options, problem):
    with pytest.raises(ValueError, match=f"backend 'cad': {problem}"):
        _call("cad", options)


def test_every_value_a_recipe_can_write_for_cad_is_taken():
    """The values a sidecar or the command line can give (numbers, names, true/false, null) run."""
    reference = _call("cad", {})
    for options in ({"eps": "auto"}, {"eps": 0, "cost_model": "flops", "cost_kernel": "reference"},
                    {"min_shard": 4, "search_width": 2, "refine_screen": None, "call_terms": "none"}):
        torch.testing.assert_close(_call("cad", options), reference)


def _model_file(path, **meta):
    """A small fitted grid saved as ``hf-longctx-lab profile-cad`` saves one, with ``meta``."""
    from hf_longctx.backends.cad.cost_model import ProfiledCostModel

    ProfiledCostModel.from_grid((16, 64), (16, 64), [[1.0, 2.0], [3.0, 8.0]], interpolate="rate").save(path, **meta)
    return str(path)


def test_a_model_file_made_ahead_prices_the_schedule(tmp_path):
    """``cost_model`` names a fitted model file: it is read (not measured) and the attention stays exact."""
    reference = _call("cad", {})
    path = _model_file(tmp_path / "model.json", device="cpu", kernel="reference")
    for options in ({"cost_model": path}, {"cost_model": path, "cost_kernel": "reference", "eps": 0.01}):
        torch.testing.assert_close(_call("cad", options), reference)


@pytest.mark.parametrize("meta,text,problem", [
    ({"device": "NVIDIA H200", "kernel": "reference"}, None, "was measured on 'NVIDIA H200', this run computes on "
                                                             "'cpu': make one with `hf-longctx-lab profile-cad"),
    ({"device": "cpu", "kernel": "torch_flash"}, None, "timed kernel 'torch_flash', cost_kernel is 'reference'"),
    ({}, "{not json", "is not a cost model \\(JSONDecodeError"),
    ({}, '{"q_lens": [1]}', "neither a launch cost model"),
], ids=["device", "kernel", "not-json", "not-a-model"])
def test_a_mismatched_model_file_is_refused_when_the_settings_are_checked(tmp_path, meta, text, problem):
    """Checked with the settings (before a model is built), never a fall back to FLOPs."""
    from hf_longctx.hf.settings.schema import LongContextConfig

    path = tmp_path / "model.json"
    if text is None:
        _model_file(path, **meta)
    else:
        path.write_text(text)
    options = {"cost_model": str(path), "cost_kernel": "reference"}
    with pytest.raises(ValueError, match=f"backend 'cad': cost_model file .*{problem}"):
        LongContextConfig(backend="cad", backend_options=options)
    with pytest.raises(ValueError, match=problem):
        _call("cad", options)


def test_options_are_one_frozen_object_the_run_never_writes():
    """The schedule and the eps it used are the run's state (what prepare returns), never left in the options:
    the next batch's call must not find the last batch's tasks."""
    import dataclasses

    from hf_longctx.backends.cad.options import CadOptions, CadRun

    options = CadOptions(eps=0.01, pingpong=False)
    before = dataclasses.asdict(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.eps = 0.2  # type: ignore[misc]
    batch = PackedBatch.from_doc_lens([48, 16])
    plan = shard_plan(batch, 2, "cad")
    run = get_backend("cad").run_context(plan, None, 0, 2, 0.25, "auto", options)
    assert isinstance(run.state, CadRun) and run.state.tasks and run.state.eps_used == 0.01
    assert run.options == options and options.tasks is None and dataclasses.asdict(options) == before
    import pickle

    assert pickle.loads(pickle.dumps(options)) == options  # as spawned ranks receive them
    given = CadOptions(tasks=list(run.state.tasks))  # a schedule's tasks given to run instead of scheduling
    assert given.tasks == run.state.tasks and get_backend("cad").prepare(plan, given) == CadRun(run.state.tasks)


def test_an_options_object_is_checked_once_when_made_not_on_every_call(monkeypatch):
    """A mapping is parsed (and checked) where it is given; an options object was checked when it was made, so the
    calls of every layer take it as it is."""
    from hf_longctx.backends.cad.options import CadOptions

    checks = []
    original = CadOptions.problem
    monkeypatch.setattr(CadOptions, "problem", lambda self: checks.append(1) or original(self))
    options = CadOptions(eps=0.01)
    assert len(checks) == 1
    _call("cad", options)
    _call("cad", options)
    assert len(checks) == 1
    _call("cad", {"eps": 0.01})
    assert len(checks) == 2


def test_the_options_of_another_backend_are_refused():
    from hf_longctx.backends.cad.options import CadOptions

    with pytest.raises(ValueError, match="backend 'ring' takes NoOptions, got CadOptions"):
        _call("ring", CadOptions())
    with pytest.raises(ValueError, match="backend 'cad': options must be a mapping of option names"):
        _call("cad", [("eps", 0.01)])


def test_the_backend_declares_its_options_type():
    from hf_longctx.backends.cad.options import CadOptions
    from hf_longctx.backends.options import NoOptions

    cad = get_backend("cad")
    assert cad.options_type is CadOptions and cad.option_names == CadOptions.names()
    assert cad.option_names[:2] == ("eps", "cost_model") and "tasks" in cad.option_names
    assert get_backend("ring").options_type is NoOptions and get_backend("ring").option_names == ()


def test_causal_is_a_field_of_the_run_not_an_option():
    """A bidirectional layer's ``causal=False`` reaches the backend in the run, and its options stay its own."""
    from hf_longctx.backends.options import NoOptions

    batch = PackedBatch.from_doc_lens([48, 16])
    plan = shard_plan(batch, 1, "contiguous")
    run = get_backend("ulysses").run_context(plan, None, 0, 1, 0.25, "auto", NoOptions(), causal=False)
    assert run.causal is False and run.options == NoOptions()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    out = sequence_parallel_attention(q, k, v, plan=plan, backend="ulysses", causal=False, rank=0)
    from hf_longctx.backends import segment_attention

    cu = batch.cu_seqlens.tolist()
    torch.testing.assert_close(out, segment_attention(q, k, v, cu, cu, causal=False), rtol=1e-9, atol=1e-12)


def test_shard_batch_parses_a_mapping_for_the_model_it_is_given():
    """With ``model=``, the backend is known: a misspelt option fails at shard_batch, before any forward."""
    from types import SimpleNamespace

    from hf_longctx.backends.cad.options import CadOptions
    from hf_longctx.hf import shard_batch

    batch = PackedBatch.from_doc_lens([48, 16])
    plan = shard_plan(batch, 1, "cad")
    class Model(torch.nn.Module):  # what shard_batch checks of a model: its config and a forward taking positions
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            raise AssertionError("not called")

    model = Model()
    model.config = SimpleNamespace(_attn_implementation="longctx_cad")
    tokens = {"input_ids": torch.zeros(1, 64, dtype=torch.long), "position_ids": torch.arange(64)[None]}
    with pytest.raises(ValueError, match=r"has no option 'epss' \(did you mean 'eps'\?\)"):
        shard_batch(tokens, plan, 0, options={"epss": 0.01}, model=model)
    local = shard_batch(tokens, plan, 0, options={"eps": 0.01}, model=model)
    assert local["longctx"].options == CadOptions(eps=0.01)
    unparsed = shard_batch(tokens, plan, 0, options={"eps": 0.01})  # parsed at the first attention call
    assert unparsed["longctx"].options_for("cad") == CadOptions(eps=0.01)
    assert unparsed["longctx"].options_for("cad") is unparsed["longctx"].options_for("cad")
