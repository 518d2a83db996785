"""The memory model against measured CPU tensor bytes, the planner's decisions on the Llama-3-8B shape,
and per-layer checkpointing with partial offload (exact gradients)."""

from __future__ import annotations

import types

import pytest
import torch
from memory_windows import measured_runs, model_of_run, predicted_windows
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.backends.op import ATTENTION_OUTPUTS
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.memory.checkpointing import enable_per_layer_checkpointing, enable_recompute_aware_checkpointing
from hf_longctx.hf.memory.enable import enable_memory_options
from hf_longctx.hf.memory.model import (
    GiB,
    LayerChoice,
    MemoryModel,
    ModelShape,
    default_host_overhead,
    pinned_parameter_bytes,
)
from hf_longctx.hf.memory.search import MemoryPlanError, plan_memory
from hf_longctx.hf.memory.training import plan_for_training
from hf_longctx.layout import PackedBatch

H200_GPU = 143771 << 20  # what nvidia-smi reports for an H200 (141 GB)
H100_GPU = 81559 << 20  # an H100 80GB HBM3
HOST = 125 * GiB
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8)
K = 1024


def _tiny(layers=3, dtype=torch.bfloat16, tied=False, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      attn_implementation="longctx_local")
    return LlamaForCausalLM(cfg).to(dtype)


def _batch(tokens: int, seed: int = 1, docs=None):
    packed = PackedBatch.from_doc_lens(docs or [tokens])
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "position_ids": packed.position_ids[None]}
    return shard_batch(batch, plan_for(packed, "local", None), 0)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- the model against measured bytes ---------------------------------------------------------

@pytest.mark.parametrize("dtype,precision,tied", [(torch.bfloat16, "bf16", False), (torch.float32, "fp32", True)])
def test_weights_grads_and_optimizer_states_match_a_trained_model(dtype, precision, tied):
    """Exact: parameter, gradient and AdamW-moment bytes of a tiny Llama after one step."""
    model = _tiny(dtype=dtype, tied=tied)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**_batch(64)).loss.backward()
    opt.step()
    predicted = MemoryModel(ModelShape.from_config(model.config), 64, precision=precision)
    params = list(model.parameters())
    assert predicted.shape.params == sum(p.numel() for p in params)
    assert predicted.weights == _nbytes(params)
    grads = predicted.grad_head + predicted.shape.layers * predicted.grad_layer + predicted.grad_embedding
    assert grads == _nbytes(p.grad for p in params)
    states = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert predicted.optimizer_gpu == _nbytes(states)


class _SavedPerLayer:
    """Storages autograd saves inside each decoder layer's call (parameters and integer tensors left out)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.layers: list[dict[int, int]] = []
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_pre_hook(self._enter))
            self.handles.append(layer.register_forward_hook(self._exit))

    def _enter(self, module, args):
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if t.is_floating_point() and storage.data_ptr() not in self.params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        module._saved_probe = (hooks, seen)

    def _exit(self, module, args, output):
        hooks, seen = module.__dict__.pop("_saved_probe")
        hooks.__exit__(None, None, None)
        self.layers.append(seen)

    def per_layer_bytes(self) -> list[int]:
        shared = set.intersection(*(set(s) for s in self.layers))  # RoPE cos/sin, passed to every layer
        return [sum(n for ptr, n in s.items() if ptr not in shared) for s in self.layers]


@pytest.mark.parametrize("mode", ["none", "layer", "recompute_aware"])
def test_what_each_layer_keeps_matches_the_model(mode):
    """Exact for both checkpointing modes (the layer input; plus the kept attention output and lse) and
    for a layer without checkpointing (norms, q/k/v, attention output and lse, MLP intermediates)."""
    tokens, layers = 128, 3
    model = _tiny(layers)
    model.train()
    enable_per_layer_checkpointing(model, [mode] * layers)
    probe = _SavedPerLayer(model)
    kept = []
    with ATTENTION_OUTPUTS.watch(lambda t: kept.append(t.untyped_storage().nbytes())):
        loss = model(**_batch(tokens)).loss
    predicted = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16")
    saved = probe.per_layer_bytes()
    if mode == "recompute_aware":  # the kept outputs live in the checkpoint cache, out of the hooks' reach
        saved = [s + sum(kept) // layers for s in saved]
    assert saved == [predicted.checkpoint[mode]] * layers
    loss.backward()


def test_tiled_mlp_layers_keep_no_mlp_intermediates():
    tokens, layers = 128, 2
    model = _tiny(layers)
    model.train()
    enable_memory_options(model, tiled_mlp=32)
    probe = _SavedPerLayer(model)
    model(**_batch(tokens)).loss.backward()
    predicted = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16", tiled_mlp=32)
    assert probe.per_layer_bytes() == [predicted.checkpoint["none"]] * layers


def test_offloaded_checkpoints_take_their_power_of_two_host_bytes():
    shape = ModelShape.from_config(LLAMA3_8B)
    model = MemoryModel(shape, 384 * K)  # 3 GiB of layer input per layer: pinned blocks round up to 4 GiB
    assert model.checkpoint["layer"] == 3 * GiB and model.host_checkpoint["layer"] == 4 * GiB
    host = model.host_items([LayerChoice("layer", True)] * 2 + [LayerChoice("layer")] * 30)
    assert host["pinned checkpoints"] == 8 * GiB and host["fixed overhead"] == default_host_overhead(1)


def test_the_model_reproduces_the_gpu_measurements_it_was_calibrated_on():
    """bench/RESULTS.md, one H200, full 8B shape: layer checkpointing, tiled loss 8192, tiled MLP 16384."""
    shape = ModelShape.from_config(LLAMA3_8B)
    for tokens, offload, measured in ((128 * K, False, 97.8), (192 * K, False, 123.6), (256 * K, True, 101.6)):
        model = MemoryModel(shape, tokens, tiled_loss=8192, tiled_mlp=16384)
        peak = model.gpu_peak([LayerChoice("layer", offload)] * 32)[0] / GiB
        assert measured <= peak <= 1.05 * measured, (tokens, peak)


# --- the planner on the Llama-3-8B shape -------------------------------------------------------

def test_plan_128k_on_an_h200_checkpoints_almost_everything_on_the_gpu():
    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H200_GPU, host_bytes=HOST)
    assert plan.gpu_peak <= plan.gpu_usable and plan.host_peak <= HOST
    assert plan.offloaded_layers <= 12  # a minority of the layers offloaded (10 in the plan that ran on an H200)
    assert plan.checkpointing == "recompute_aware" and plan.tiled_loss
    assert "none" in {c.checkpointing for c in plan.layers}  # spare memory buys a layer without recompute
    text = str(plan)
    assert "recompute_aware" in text and "GPU GiB" in text and len(text.splitlines()) <= 8


def test_plan_256k_on_an_h200_offloads_only_what_the_host_holds():
    plan = plan_memory(LLAMA3_8B, 256 * K, gpu_bytes=H200_GPU, host_bytes=HOST)
    every = MemoryModel(plan.shape, 256 * K).host_checkpoint["recompute_aware"] * 32
    assert every > HOST  # all 32 checkpoints would not fit the host...
    assert 0 < plan.offloaded_layers < 32  # ...so some stay on the GPU
    assert plan.host_peak <= HOST and plan.gpu_peak <= plan.gpu_usable
    assert plan.tiled_loss and plan.tiled_mlp
    opts = plan.memory_options()
    assert sum(offload for _, offload in opts["layers"]) == plan.offloaded_layers


def test_plan_512k_on_one_h200_names_the_shortfall_and_what_would_fit():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(LLAMA3_8B, 512 * K, gpu_bytes=H200_GPU, host_bytes=HOST)
    text = str(err.value)
    assert "524288 tokens per GPU do not fit" in text and "GiB of GPU memory" in text
    assert "sp_size 2: 262144 tokens per GPU" in text
    assert "at most" in text and "tokens per GPU fit here" in text
    # what the hint promises does fit
    plan_memory(LLAMA3_8B, 256 * K, sp_size=2, gpu_bytes=H200_GPU, host_bytes=HOST)


def test_plan_on_an_h100_suggests_sharding_when_more_gpus_alone_would_not_do():
    plan = plan_memory(LLAMA3_8B, 64 * K, gpu_bytes=H100_GPU, host_bytes=HOST)
    assert plan.gpu_peak <= plan.gpu_usable
    with pytest.raises(MemoryPlanError, match="under DeepSpeed ZeRO-2"):
        plan_memory(LLAMA3_8B, 256 * K, gpu_bytes=H100_GPU, host_bytes=HOST)


def test_optimizer_on_the_host_only_when_allowed_and_needed():
    """One H100: 128K does not fit with AdamW on the GPU; with torchao's offload optimizer the host holds pinned
    copies of every parameter and gradient (power-of-two blocks) and the moments, and the GPU no gradients."""
    with pytest.raises(MemoryPlanError, match="optimizer states on the host"):
        plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H100_GPU, host_bytes=HOST)
    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H100_GPU, host_bytes=HOST, allow_optimizer_on_host=True)
    shape = ModelShape.from_config(LLAMA3_8B)
    assert plan.optimizer_on_host
    assert plan.host_items["optimizer"] == 2 * pinned_parameter_bytes(shape, 2) + shape.params * 4
    assert "optimizer" not in plan.gpu_items or plan.gpu_items["optimizer"] == 0
    # where everything fits on the GPU, the host optimizer's slower step is not chosen
    assert not plan_memory(LLAMA3_8B, 32 * K, gpu_bytes=H200_GPU, host_bytes=HOST,
                           allow_optimizer_on_host=True).optimizer_on_host


def test_pinned_copies_round_each_tensor_up_to_a_power_of_two():
    shape = ModelShape.from_config(LLAMA3_8B)
    # gate/up/down (4096 x 14336 bf16 = 112 MiB) take 128 MiB blocks; q/o 32 MiB and k/v 8 MiB are exact
    per_layer = 3 * 128 + 2 * 32 + 2 * 8
    embedding = 1024  # 128256 x 4096 bf16 = 1002 MiB in a 1 GiB block, twice (untied head)
    small = (2 * 32 + 1) * 8192 / (1 << 20)  # the norms' 8 KiB blocks
    assert pinned_parameter_bytes(shape, 2) == int(((32 * per_layer + 2 * embedding) + small) * (1 << 20))


def test_zero_and_recipe_restrictions():
    plan = plan_memory(LLAMA3_8B, 64 * K, gpu_bytes=H200_GPU, host_bytes=HOST, zero_stage=3, world=8)
    assert plan.tiled_mlp == 0  # the tiled MLP cannot run under ZeRO-3
    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H200_GPU, host_bytes=HOST, modes=("none", "layer"))
    assert {c.checkpointing for c in plan.layers} <= {"none", "layer"}
    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H200_GPU, host_bytes=HOST, allow_offload=False)
    assert plan.offloaded_layers == 0 and plan.gpu_peak <= plan.gpu_usable


def test_everything_fits_means_no_checkpointing():
    plan = plan_memory(_tiny().config, 256, gpu_bytes=64 * GiB, host_bytes=HOST)
    assert plan.checkpointed_layers == 0 and plan.tiled_loss == 0 and plan.tiled_mlp == 0
    assert plan.step_factor == 1.0


# --- per-layer checkpointing and partial offload ---------------------------------------------

CHOICES = [("recompute_aware", True), ("layer", True), ("recompute_aware", False), ("layer", False), ("none", False)]


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_partial_offload_gives_the_same_gradients_bitwise():
    model = _tiny(layers=len(CHOICES), dtype=torch.float64, seed=5)
    model.train()
    batch = _batch(96, seed=2, docs=[40, 7, 49])
    plain = _grads(model, batch)  # no checkpointing
    enable_per_layer_checkpointing(model, [(mode, False) for mode, _ in CHOICES])
    on_device = _grads(model, batch)
    enable_recompute_aware_checkpointing(model, offload=True)
    model._hf_longctx_offloader.min_bytes = 0
    everything = _grads(model, batch)
    enable_per_layer_checkpointing(model, CHOICES)
    offloader = model._hf_longctx_offloader
    offloader.min_bytes = 0  # the tiny model's tensors are below the default threshold
    partial = _grads(model, batch)
    assert offloader.layers_offloaded == 2
    tokens, hidden, heads = 96, model.config.hidden_size, model.config.num_attention_heads
    assert offloader.bytes_offloaded == 8 * (2 * tokens * hidden + tokens * hidden + heads * tokens)
    assert [m.gradient_checkpointing for m in model.model.layers] == [True, True, True, True, False]
    for name in plain:
        for other in (on_device, everything, partial):
            torch.testing.assert_close(other[name], plain[name], rtol=0, atol=0, msg=name)


def test_memory_options_take_a_plan():
    model = _tiny(layers=2, dtype=torch.float64)
    model.train()
    batch = _batch(64)
    want = _grads(model, batch)
    plan = plan_memory(model.config, 64, gpu_bytes=64 * GiB, host_bytes=HOST, precision="fp64")
    plan.layers = (LayerChoice("recompute_aware", True), LayerChoice("none"))
    plan.tiled_loss, plan.tiled_mlp = 16, 24
    options = plan.apply(model)
    model._hf_longctx_offloader.min_bytes = 0
    assert options.checkpointing == "recompute_aware" and options.tiled_loss is not None and options.tiled_mlp
    got = _grads(model, batch)
    for name, grad in want.items():  # transformers' own loss upcasts to float32 only, the tiled loss keeps float64
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="no checkpoint to offload"):
        enable_memory_options(model, layers=[("none", True), ("layer", False)])
    with pytest.raises(ValueError, match="3 per-layer choices for the 2"):
        enable_memory_options(model, layers=["layer"] * 3)


# --- the recipe key ----------------------------------------------------------------------------

def test_memory_key_is_validated(monkeypatch):
    from hf_longctx.hf import LongContextConfig, load_config

    assert LongContextConfig().memory == "manual"
    with pytest.raises(ValueError, match="unknown memory 'atuo'; did you mean 'auto'"):
        LongContextConfig.from_dict({"memory": "atuo"})
    with pytest.raises(ValueError, match="did you mean 'memory'"):
        LongContextConfig.from_dict({"memroy": "auto"})
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("HF_LONGCTX_MEMORY", "auto")
    assert load_config().memory == "auto"
    monkeypatch.delenv("HF_LONGCTX_MEMORY")
    assert load_config(overrides={"memory": "auto"}).memory == "auto"


def test_a_training_run_plan_on_cpu_uses_host_memory_and_offloads_nothing():
    from hf_longctx.hf import LongContextConfig

    model = _tiny()
    plan = plan_for_training(model, LongContextConfig(memory="auto", seq_len=256, checkpointing="layer"))
    assert plan.offloaded_layers == 0 and {c.checkpointing for c in plan.layers} <= {"none", "layer"}
    rows = types.SimpleNamespace(dataset=[{"input_ids": list(range(300))}])  # the data's rows beat seq_len
    assert plan_for_training(model, LongContextConfig(memory="auto", seq_len=256),
                             train_dataloader=rows).tokens_per_gpu == 300


def test_host_memory_is_capped_by_the_cgroup_and_can_be_set(monkeypatch):
    """A container's limit, not /proc/meminfo, is what a process may pin; the variable wins over both."""
    from hf_longctx.hf.memory import machine

    monkeypatch.delenv("HF_LONGCTX_HOST_MEMORY_GIB", raising=False)
    total = machine.host_memory_bytes()
    monkeypatch.setattr(machine, "_cgroup_limit", lambda: 3 * 2**30)
    assert machine.host_memory_bytes() == min(total, 3 * 2**30)
    monkeypatch.setenv("HF_LONGCTX_HOST_MEMORY_GIB", "125")
    assert machine.host_memory_bytes() == 125 * 2**30


def test_fused_ops_keep_less_per_layer_and_take_one_h200_to_512k():
    """Liger's RMSNorm keeps no float32 upcast: a layer's backward needs 8 bytes per hidden element less (32 KiB
    per token for the 8B shape; 35 measured), and under checkpointing the input it keeps is the checkpoint, counted
    once. With it one H200 with 125 GiB of host memory trains 512K tokens a step without checkpoint groups; 544K does
    not fit without them."""
    shape = ModelShape.from_config(LLAMA3_8B)
    plain = MemoryModel(shape, 512 * K, tiled_mlp=16384)
    fused = MemoryModel(shape, 512 * K, tiled_mlp=16384, fused_ops=True)
    # no float32 upcast (8 bytes), and the kept input (2 bytes) is the checkpoint
    assert plain.backward_work["layer"] - fused.backward_work["layer"] == 512 * K * (8 + 2) * shape.hidden
    for mode in ("layer", "recompute_aware"):  # measured: the fused norm lowers no checkpointed layer's forward peak
        assert fused.forward_work[mode] == plain.forward_work[mode]
    assert fused.forward_work["none"] < plain.forward_work["none"]  # measured: it lowers an uncheckpointed one's
    assert fused.checkpoint["layer"] == plain.checkpoint["layer"]  # the layer input is what a checkpoint keeps
    plan = plan_memory(LLAMA3_8B, 512 * K, gpu_bytes=H200_GPU, host_bytes=HOST, fused_ops=True,
                       allow_optimizer_on_host=True, allow_groups=False)
    assert plan.fused_ops and plan.gpu_peak <= plan.gpu_usable and plan.host_peak <= HOST
    assert "fused ops Liger" in str(plan)
    with pytest.raises(MemoryPlanError, match="do not fit"):  # without checkpoint groups (test_group_checkpointing)
        plan_memory(LLAMA3_8B, 544 * K, gpu_bytes=H200_GPU, host_bytes=HOST, fused_ops=True,
                    allow_optimizer_on_host=True, allow_groups=False)
    with pytest.raises(MemoryPlanError):
        plan_memory(LLAMA3_8B, 448 * K, gpu_bytes=H200_GPU, host_bytes=HOST, fused_ops=False, allow_groups=False)


def test_fused_ops_are_refused_where_liger_cannot_run():
    from hf_longctx.hf.memory.fused_ops import enable_fused_ops, fused_ops_available

    model = _tiny(2)
    assert not fused_ops_available("cpu")
    with pytest.raises(RuntimeError, match="fused_ops: off"):
        enable_fused_ops(model)
    plan = plan_memory(model.config, 64, gpu_bytes=8 * GiB, host_bytes=8 * GiB, host_overhead_bytes=0, fused_ops=False)
    assert not plan.fused_ops and "fused ops off" in str(plan)


def test_the_model_against_its_gpu_measurements_layer_by_layer():
    """tests/memory_measurements.json "runs": the GPU peak of both decoder layers' forward and backward, 8B-shaped
    layers on an H100 (64K and 192K tokens, both norms, tiled and untiled MLPs, recompute-aware and layer
    checkpointing). The model never predicts less than was measured, and at most 10% more for a layer's backward
    (the phase that sets the step's peak) and 25% more for its forward."""
    runs = measured_runs("runs")
    assert runs
    for run in runs:
        assert run["optimizer_states_allocated"]
        model, layers = model_of_run(run)
        windows = predicted_windows(model, layers)
        for name, high in (("forward", 1.25), ("backward", 1.10)):
            for i, measured in enumerate(run["layer_peak_gib"][name]):
                ratio = windows[name][i] / measured
                assert 1.0 <= ratio <= high, (run["command"], name, i, ratio)
        assert run["step_peak_gib"] <= model.gpu_peak(layers)[0] / GiB <= 1.05 * run["step_peak_gib"], run["command"]


def test_a_kernel_whose_layers_were_not_measured_keeps_the_older_bounds():
    """tests/memory_measurements.json "superseded_runs": windows measured with kernel auto, cuDNN's kernels where they
    served. A kernel outside LAYER_MEASURED_KERNELS (cuDNN's varlen one) is planned above every one of them."""
    runs = measured_runs("superseded_runs")
    assert runs
    for run in runs:
        model, layers = model_of_run(run, kernel="cudnn_varlen")
        missing = 0 if run["optimizer_states_allocated"] else model.optimizer_gpu / GiB
        windows = predicted_windows(model, layers)
        for name in ("forward", "backward"):
            for i, measured in enumerate(run["layer_peak_gib"][name]):
                if layers[i].checkpointing != "group":
                    assert windows[name][i] >= measured + missing, (run["command"], name, i)


def test_the_loss_phase_holds_the_output_projections_gradient_twice_when_the_loss_is_tiled():
    """Autograd sums the chunks' gradients of the output projection before its .grad exists: the sum so far and the
    chunk being added are both there, wherever AdamW lives (a host optimizer copies the gradient only afterwards)."""
    shape = ModelShape.from_config(LLAMA3_8B)
    head_gradient = shape.vocab * shape.hidden * 2
    layers = [LayerChoice("layer")] * shape.layers
    for on_host in (False, True):
        tiled = MemoryModel(shape, 64 * K, tiled_loss=8192, optimizer_on_host=on_host)
        assert tiled.gpu_phases(layers)["loss"]["grads"] == 2 * head_gradient
    whole = MemoryModel(shape, 8 * K, tiled_loss=0, optimizer_on_host=True)
    assert whole.gpu_phases(layers)["loss"]["grads"] == head_gradient


def test_the_model_against_whole_steps_measured_after_a_warm_up_step():
    """bench/RESULTS.md, steps timed after a first one (AdamW's states present): the step's peak within 1%."""
    shape = ModelShape.from_config(LLAMA3_8B)

    def layout(*runs):
        return [LayerChoice(mode, offload) for count, mode, offload in runs for _ in range(count)]

    runs = [  # tokens, tiled loss, tiled MLP, layers, measured GiB (H200 at 128K, H100 at 112K)
        (128 * K, 8192, 0, layout((22, "recompute_aware", True), (7, "recompute_aware", False), (3, "none", False)),
         125.9),
        (112 * K, 2048, 16384, layout((25, "layer", True), (4, "layer", False), (3, "none", False)), 75.4),
    ]
    for tokens, loss, mlp, layers, measured in runs:
        model = MemoryModel(shape, tokens, tiled_loss=loss, tiled_mlp=mlp, fused_ops=True)
        peak = model.gpu_peak(layers)[0] / GiB
        assert 0.99 * measured <= peak <= 1.01 * measured, (tokens, peak, measured)


def test_a_plan_with_adamw_on_the_host_refuses_an_optimizer_on_the_gpu():
    from hf_longctx.hf.memory.optimizer_offload import check_optimizer_place, optimizer_offload_reason
    from hf_longctx.hf.settings.schema import ConfigError

    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=H100_GPU, host_bytes=HOST, allow_optimizer_on_host=True)
    assert plan.optimizer_on_host
    gpu_adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match="trainer_optimizer_cls_and_kwargs"):
        check_optimizer_place(plan, gpu_adamw)
    check_optimizer_place(plan, None)  # no optimizer yet (the script builds the right one)
    assert optimizer_offload_reason("cpu") is not None  # torchao's offload needs a CUDA device


def test_fused_ops_key_is_checked_and_honoured(monkeypatch):
    from hf_longctx.hf.settings.schema import ConfigError, LongContextConfig

    with pytest.raises(ValueError, match="did you mean 'liger'"):
        LongContextConfig(fused_ops="ligre")
    monkeypatch.setattr("hf_longctx.hf.settings.schema.liger_installed", lambda: False)
    with pytest.raises(ValueError, match="pip install 'hf_longctx\\[liger\\]'"):
        LongContextConfig(fused_ops="liger")
    model = _tiny(2)
    assert not plan_for_training(model, LongContextConfig(memory="auto", fused_ops="off", seq_len=64)).fused_ops
    # liger where its kernels cannot run: said before any step, naming the way out
    monkeypatch.setattr("hf_longctx.hf.settings.schema.liger_installed", lambda: True)
    monkeypatch.setattr("hf_longctx.hf.memory.fused_ops.liger_installed", lambda: True)
    monkeypatch.setattr("hf_longctx.hf.memory.fused_ops.uses_fused_norms", lambda model: False)
    with pytest.raises(ConfigError, match="need a CUDA GPU; set fused_ops: auto or off"):
        plan_for_training(model, LongContextConfig(memory="auto", fused_ops="liger", seq_len=64))


# --- the probe that checks the model layer by layer --------------------------------------------

@pytest.mark.parametrize("outer_checkpoint", [False, True])
def test_layer_peak_probe_opens_one_window_per_layer_and_pass(monkeypatch, outer_checkpoint):
    """Each layer's forward window is read in the forward pass only (a checkpoint whose recompute calls the layers
    again in backward, here one around the whole model, is part of the backward windows, not a second forward),
    and each layer's backward window closes at the gradient of its input: last layer first."""
    from torch.utils.checkpoint import checkpoint

    from hf_longctx.hf.memory import layer_peaks

    clock = iter(range(1, 10**6))  # the allocator's "peak" grows with every read: the order of the reads
    monkeypatch.setattr(layer_peaks.torch.cuda, "max_memory_allocated", lambda device=None: next(clock))
    monkeypatch.setattr(layer_peaks.torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    model = _tiny(3, dtype=torch.float32)
    model.train()
    enable_per_layer_checkpointing(model, ["layer", "recompute_aware", "none"])
    batch = _batch(32)
    with layer_peaks.LayerPeakProbe(model, torch.device("cpu")) as probe:
        if outer_checkpoint:
            loss = checkpoint(lambda ids, pos: model(input_ids=ids, position_ids=pos).logits.float().square().mean(),
                              batch["input_ids"], batch["position_ids"], use_reentrant=False)
        else:
            loss = model(**batch).loss
        forward_ended = next(clock)
        loss.backward()
    forward, backward = probe.peaks.forward, probe.peaks.backward
    assert forward == sorted(forward) and all(0 < f < forward_ended for f in forward)
    assert backward == sorted(backward, reverse=True) and min(backward) > forward_ended


def test_the_plan_predicts_each_layer_and_its_worst_backward_is_the_backward_phase():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    plan = plan_memory(cfg, 256 * 1024, gpu_bytes=140 * GiB, host_bytes=125 * GiB, fused_ops=True)
    assert len(plan.layer_forward_peak) == len(plan.layer_backward_peak) == 32
    phases = MemoryModel(plan.shape, plan.tokens_per_gpu, tiled_loss=plan.tiled_loss, tiled_mlp=plan.tiled_mlp,
                         fused_ops=True).gpu_phases(plan.layers)
    backward = next(items for name, items in phases.items() if name.startswith("backward"))
    assert max(plan.layer_backward_peak) == sum(backward.values())
    assert plan.layer_forward_peak[-1] == sum(phases["forward"].values())


def test_a_context_the_host_cannot_hold_names_the_host_and_by_how_much():
    """640K on one H200 with 125 GiB of host memory: offloading every checkpoint would fit the GPU, but the host
    holds 7 of 32 beside AdamW's states; the message names the host as the bound and the shortfall."""
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(LLAMA3_8B, 640 * K, gpu_bytes=H200_GPU, host_bytes=HOST, fused_ops=True,
                    allow_optimizer_on_host=True, kernel="fa4")
    text = str(err.value)
    assert "host memory binds: 7 of 32 checkpoints fit on the host" in text
    assert "199.9 GiB short of holding every one" in text
    assert "more host memory: 324.9 GiB (has 125.0)" in text
    assert "at most 552960 tokens per GPU fit here with group checkpointing" in text
