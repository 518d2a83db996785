"""AdamW's states in 8 or 4 bits (torchao's AdamW8bit / AdamW4bit): what the plan counts is what the optimizer
allocates, the run's choice is read from its optimizer or its Trainer arguments and kept wherever the plan puts
AdamW, and the plan never picks them itself but names them when they would make a context fit.

torchao's low-bit optimizers run on the CPU (compiled there), which is where the host offload optimizer runs them;
the offload optimizer itself needs a GPU (tests/gpu/test_optimizer_offload_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_longctx.hf import LongContextConfig
from hf_longctx.hf.memory.adam_states import AdamStates, adam_states_of, trainer_adam_states
from hf_longctx.hf.memory.model import MemoryModel, ModelShape, parameter_tensor_elements
from hf_longctx.hf.memory.optimizer_offload import trainer_optimizer_cls_and_kwargs
from hf_longctx.hf.memory.optimizer_states import allocate_optimizer_states
from hf_longctx.hf.memory.search import MemoryPlanError, plan_memory
from hf_longctx.hf.memory.training import plan_for_training
from hf_longctx.hf.settings.schema import ConfigError

ao = pytest.importorskip("torchao.optim")

GiB = 1 << 30
LOW_BIT = {8: ao.AdamW8bit, 4: ao.AdamW4bit}
# the 8B shape on one H200 and its 125 GiB host (tests/test_memory_plan.py)
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8)
H200_GPU, HOST = 143771 << 20, 125 * GiB


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=65, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def _parameters() -> list[torch.nn.Parameter]:
    """One parameter of each kind torchao tells apart: 4096 elements (quantized), 4160 (over 4096 but no whole
    number of 256-element blocks: plain moments) and 2048 (under 4096: plain moments). Few shapes, since torchao
    compiles its step once per shape."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(rows, 64, dtype=torch.bfloat16)) for rows in (64, 65, 32)]


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor the optimizer's states hold, a quantized state's inner tensors included."""
    total = 0
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if type(value) is torch.Tensor:
                total += value.nbytes
            else:
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, name).nbytes for name in names)
    return total


@pytest.mark.parametrize("bits", [8, 4])
def test_the_planned_state_bytes_are_what_torchaos_optimizer_allocates(bits):
    params = _parameters()
    elements = [p.numel() for p in params]
    opt = LOW_BIT[bits](params, lr=1e-3)
    allocate_optimizer_states(opt)
    assert _state_bytes(opt) == AdamStates(bits, opt.block_size).state_bytes(elements, element_bytes=2)
    plain = torch.optim.AdamW(params, lr=1e-3)
    allocate_optimizer_states(plain)
    assert _state_bytes(plain) == AdamStates().state_bytes(elements, element_bytes=2)


def test_the_model_lists_the_parameter_tensors_the_model_has():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=65, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    shape = ModelShape.from_config(model.config)
    assert sorted(parameter_tensor_elements(shape)) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("bits", [8, 4])
def test_states_allocated_before_the_first_step_change_no_step(bits):
    """A quantized state is made fresh as torchao makes it (zero codes and scales), not by quantizing zeros: a
    4-bit map has no exact zero, and quantized zeros would change every later step."""
    fresh, early = _parameters(), _parameters()
    fresh_opt = LOW_BIT[bits](fresh, lr=1e-2, weight_decay=0.1)
    early_opt = LOW_BIT[bits](early, lr=1e-2, weight_decay=0.1)
    allocate_optimizer_states(early_opt)
    assert all(float(s["step"]) == 0 for s in early_opt.state.values())
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in fresh]
        for params, opt in ((fresh, fresh_opt), (early, early_opt)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
        for i, (a, b) in enumerate(zip(fresh, early)):
            assert torch.equal(a, b), f"step {step}, parameter {i}"


def test_low_bit_states_take_their_bytes_off_wherever_adamw_is():
    shape = ModelShape.from_config(LLAMA3_8B)
    elements = parameter_tensor_elements(shape)
    full, low = AdamStates().state_bytes(elements, 2), AdamStates(8).state_bytes(elements, 2)
    assert full / low == pytest.approx(2 / (1 + 4 / 256), rel=1e-4)  # 1 byte and a 4-byte scale per 256 elements
    for on_host in (False, True):
        a = MemoryModel(shape, 65536, optimizer_on_host=on_host)
        b = MemoryModel(shape, 65536, optimizer_on_host=on_host, adam_states=AdamStates(8))
        assert a.optimizer_host - b.optimizer_host == (full - low if on_host else 0)
        assert a.optimizer_gpu - b.optimizer_gpu == (0 if on_host else full - low)
    with pytest.raises(ValueError, match="float32 master weights"):
        MemoryModel(shape, 65536, precision="fp32_master", zero_stage=2, world=2, adam_states=AdamStates(8))


def test_a_context_that_fits_only_with_low_bit_states_names_them_and_the_plan_never_picks_them():
    """561,152 tokens of the 8B shape on one H200: the host holds too few checkpoints beside AdamW's 16-bit states;
    with 8-bit ones it fits. The plan says so, and plans them only when the run has them."""
    common = dict(gpu_bytes=H200_GPU, host_bytes=HOST, fused_ops=True, allow_optimizer_on_host=True, kernel="fa4")
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(LLAMA3_8B, 561152, **common)
    assert "AdamW's states in 8 bits (14.7 GiB less wherever AdamW is; TrainingArguments(optim='adamw_torch_8bit')" \
        in str(err.value)
    plan = plan_memory(LLAMA3_8B, 561152, adam_states=AdamStates(8), **common)
    assert plan.optimizer_on_host and plan.adam_states.bits == 8
    assert plan.summary()["optimizer_state_bits"] == 8 and "optimizer on host (8-bit states)" in str(plan)
    assert plan_memory(LLAMA3_8B, 65536, **common).adam_states == AdamStates()


def test_a_fitting_context_under_deepspeed_names_no_low_bit_states():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(LLAMA3_8B, 1 << 21, gpu_bytes=80 * GiB, host_bytes=HOST, zero_stage=2, world=8,
                    fused_ops=True, kernel="fa4")
    assert "8 bits" not in str(err.value)


def _args(tmp_path, optim: str, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), optim=optim, use_cpu=True, report_to=[], **kw)


@pytest.mark.parametrize(("optim", "bits", "block"), [("adamw_torch_fused", None, 256), ("adamw_torch", None, 256),
                                                      ("adamw_torch_8bit", 8, 256), ("adamw_torch_4bit", 4, 64)])
def test_the_trainers_optim_decides_the_planned_states(tmp_path, optim, bits, block):
    args = _args(tmp_path, optim, optim_args=f"block_size={block}" if bits else None)
    assert trainer_adam_states(args) == AdamStates(bits, block)
    plan = plan_for_training(_tiny_model().config, LongContextConfig(memory="auto", seq_len=64), args,
                             tokens_per_gpu=64, precision="bf16")
    assert plan.adam_states == AdamStates(bits, block)


def test_the_optimizer_the_trainer_built_decides_the_planned_states(tmp_path):
    model = _tiny_model()  # no step: nothing compiles
    assert adam_states_of(ao.AdamW8bit(model.parameters(), block_size=128)) == AdamStates(8, 128)
    assert adam_states_of(torch.optim.AdamW(model.parameters())) == AdamStates()
    assert adam_states_of(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    cfg = LongContextConfig(memory="auto", seq_len=64)
    plan = plan_for_training(model, cfg, _args(tmp_path, "adamw_torch_fused"), tokens_per_gpu=64,
                             optimizer=ao.AdamW4bit(model.parameters()))
    assert plan.adam_states == AdamStates(4, 128)
    # SGD keeps less than AdamW: planned as AdamW (an upper bound), and never on the host, which runs AdamW
    plan = plan_for_training(model, cfg, _args(tmp_path, "sgd"), tokens_per_gpu=64,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert plan.adam_states == AdamStates() and not plan.optimizer_on_host


@pytest.mark.parametrize(("optim", "optimizer_class"), [("adamw_torch_fused", torch.optim.AdamW),
                                                        ("adamw_torch_8bit", ao.AdamW8bit),
                                                        ("adamw_torch_4bit", ao.AdamW4bit)])
def test_the_host_optimizer_runs_the_adamw_the_trainer_names(tmp_path, optim, optimizer_class):
    args = _args(tmp_path, optim, learning_rate=3e-4, weight_decay=0.05, adam_beta2=0.95)
    cls, kwargs = trainer_optimizer_cls_and_kwargs(args)
    expected_class, expected = Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["optimizer_class"] is optimizer_class is expected_class
    assert {k: v for k, v in kwargs.items() if k not in ("optimizer_class", "weight_decay")} == expected
    assert kwargs["weight_decay"] == 0.05 and kwargs["lr"] == 3e-4 and kwargs["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("optim", ["sgd", "adafactor"])
def test_an_optimizer_the_host_cannot_run_is_refused_by_name(tmp_path, optim):
    with pytest.raises(ConfigError, match=f"optim='{optim}'.*is not AdamW: set optim to adamw_torch_fused"):
        trainer_optimizer_cls_and_kwargs(_args(tmp_path, optim))


def test_low_bit_states_are_only_those_torchao_has():
    with pytest.raises(ValueError, match="8 or 4 bits"):
        AdamStates(2)
