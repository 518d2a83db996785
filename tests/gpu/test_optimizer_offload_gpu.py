"""AdamW on the host (torchao's offload optimizer behind HostOffloadAdamW) steps like AdamW on the GPU.

The same tiny float32 model trained three steps with each optimizer: the parameters agree to float32
rounding after every step, with and without gradient clipping (which the host optimizer applies to its
host copies, since the GPU gradients are gone by the time the Trainer would clip). A gradient that
arrives twice before a step (gradient accumulation) is refused. Through the Trainer and the long-context
callback the losses and gradient norms match a run with the Trainer's own AdamW. torchao's 8- and 4-bit AdamW on
the host steps as the same optimizer does on CPU copies of the parameters, and the Trainer's
``optim="adamw_torch_8bit"`` runs there as it asks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_longctx
from hf_longctx.hf.memory.optimizer_offload import HostOffloadAdamW, trainer_optimizer_cls_and_kwargs
from hf_longctx.hf.settings.schema import LongContextConfig

pytest.importorskip("torchao")


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).cuda()


def _loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 97, (2, 64), generator=g).cuda()
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_host_adamw_steps_like_adamw_on_the_gpu(max_grad_norm):
    ref, host = _model(), _model()
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **settings)
    host_opt = HostOffloadAdamW(host.parameters(), max_grad_norm=max_grad_norm, **settings)
    for step in range(3):
        _loss(ref, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm or float("inf"))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        _loss(host, step).backward()
        host_opt.step()
        host_opt.zero_grad()
        assert host_opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        for (name, a), b in zip(ref.named_parameters(), host.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}, {name}")
    if max_grad_norm:
        assert norm > max_grad_norm  # the clip did act


@pytest.mark.parametrize("bits", [8, 4])
def test_host_low_bit_adamw_steps_as_the_same_optimizer_on_cpu_copies(bits):
    """The host runs torchao's low-bit AdamW on its copies of the parameters: given the same gradients, the same
    optimizer on CPU copies gives the same parameters, bit for bit (the small parameters, which stay with the
    optimizer on the GPU, to float32 rounding)."""
    from torchao.optim import AdamW4bit, AdamW8bit

    from hf_longctx.hf.memory.optimizer_offload import MINIMAL_OFFLOAD_ELEMENTS

    cls = {8: AdamW8bit, 4: AdamW4bit}[bits]
    host = _low_bit_model()
    ref = [torch.nn.Parameter(p.detach().cpu().clone()) for p in host.parameters()]
    grads: dict[int, torch.Tensor] = {}
    for i, p in enumerate(host.parameters()):  # before the optimizer's hooks, which free the GPU gradient
        p.register_post_accumulate_grad_hook(lambda p, i=i: grads.__setitem__(i, p.grad.detach().cpu().clone()))
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = cls(ref, **settings)
    host_opt = HostOffloadAdamW(host.parameters(), optimizer_class=cls, **settings)
    assert host_opt.adam_states.bits == bits
    for step in range(3):
        ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(step)).cuda()
        host(input_ids=ids, labels=ids).loss.backward()
        host_opt.step()
        host_opt.zero_grad()
        for i, p in enumerate(ref):
            p.grad = grads[i]
        ref_opt.step()
        for (name, b), a in zip(host.named_parameters(), ref):
            if a.numel() >= MINIMAL_OFFLOAD_ELEMENTS:
                assert torch.equal(b.detach().cpu(), a.detach()), f"step {step}, {name}"
            else:
                torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-7,
                                           msg=f"step {step}, {name}")


def _low_bit_model() -> LlamaForCausalLM:
    """Quantized moments need 4096 elements and whole 256-element blocks: these tensors have them."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).cuda()


@pytest.mark.parametrize("on_host", [False, True, "8bit"])
def test_states_allocated_before_the_first_step_change_no_step(on_host):
    """A benchmark that times the first step allocates AdamW's states first (on the GPU or on the host):
    the training that follows is the training without it, bit for bit."""
    from hf_longctx.hf.memory.optimizer_states import allocate_optimizer_states

    def make(model):
        if on_host == "8bit":
            from torchao.optim import AdamW8bit

            return HostOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, optimizer_class=AdamW8bit)
        if on_host:
            return HostOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    fresh, early = _model(), _model()
    fresh_opt, early_opt = make(fresh), make(early)
    before = torch.cuda.memory_allocated()
    allocate_optimizer_states(early_opt)
    states_bytes = sum(p.numel() * p.element_size() for p in early.parameters()) * 2
    grown = torch.cuda.memory_allocated() - before
    assert grown < states_bytes // 4 if on_host else grown >= states_bytes
    for step in range(3):
        for model, opt in ((fresh, fresh_opt), (early, early_opt)):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(fresh.parameters(), early.parameters()):
            assert torch.equal(a, b), f"step {step}"


def test_gradient_accumulation_is_refused():
    model = _model()
    opt = HostOffloadAdamW(model.parameters(), lr=1e-3)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=1"):
        _loss(model, 1).backward()
    del opt


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(20, 120, (count,), generator=g).tolist()
        self.rows = [{"input_ids": torch.randint(3, 97, (n,), generator=g).tolist()} for n in lens]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(tmp_path, host: bool, optim: str = "adamw_torch_fused") -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="longctx_zigzag")
    model = LlamaForCausalLM(cfg).cuda()
    args = TrainingArguments(output_dir=str(tmp_path / f"host-{host}"), per_device_train_batch_size=4, max_steps=3,
                             logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0,
                             max_grad_norm=0.5, dataloader_num_workers=0, optim=optim)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(32),
                      data_collator=DataCollatorWithFlattening(return_position_ids=True),
                      callbacks=[hf_longctx.LongContextCallback(LongContextConfig())],
                      optimizer_cls_and_kwargs=trainer_optimizer_cls_and_kwargs(args) if host else None)
    trainer.train()
    assert args.max_grad_norm == 0.5  # the callback gives the Trainer its setting back
    logs = trainer.state.log_history
    return [e["loss"] for e in logs if "loss" in e], [e["grad_norm"] for e in logs if "grad_norm" in e]


def test_trainer_with_host_adamw_trains_like_the_trainers_adamw(tmp_path):
    losses, norms = _train(tmp_path, host=True)
    ref_losses, ref_norms = _train(tmp_path, host=False)
    assert len(losses) == len(norms) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert norms == pytest.approx(ref_norms, rel=1e-3)


def test_the_trainers_8bit_adamw_on_the_host_trains_like_the_trainers_own(tmp_path):
    losses, norms = _train(tmp_path, host=True, optim="adamw_torch_8bit")
    ref_losses, ref_norms = _train(tmp_path, host=False, optim="adamw_torch_8bit")
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    assert norms == pytest.approx(ref_norms, rel=1e-2)


def test_a_scheduler_reaches_every_group_after_a_state_round_trip():
    """accelerate round-trips the optimizer's state when it prepares it; the LR scheduler must still set the
    learning rate the optimizers read (the small parameters' on-GPU AdamW included)."""
    opt = HostOffloadAdamW(_model().parameters(), lr=1e-3)
    opt.load_state_dict(opt.state_dict())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert opt.d_opt is not None
    offloaded = [g["lr"] for o in opt.optim_dict.values() for g in o.param_groups]
    read = [g["lr"] for g in opt.d_opt.param_groups] + offloaded
    assert read and all(lr == pytest.approx(5e-4) for lr in read)
