"""`deepspeed.ops.adam.DeepSpeedCPUAdam` / `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad` under the switch:
accelerate swaps the Trainer's optimizer for them whenever the config offloads the optimizer (axolotl's
`zero2.json` does), and they must give back torch's optimizer with the same groups and update
([Note: DeepSpeed's CPU optimizers, served as torch's] in zerodist/runtime/ops/cpu_optimizers.py). Checked in a fresh
interpreter started as `zerodist run --as-deepspeed` starts each rank; before the served module,
accelerate's `map_pytorch_optim_to_deepspeed` failed with `No module named 'deepspeed.ops'`."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.test_as_deepspeed import served_python
from zerodist.runtime.ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam


@pytest.mark.unit
def test_the_served_classes_build_torchs_optimizer_and_refuse_what_torch_lacks():
    params = [torch.nn.Parameter(torch.ones(3))]
    adamw = DeepSpeedCPUAdam(params, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    assert type(adamw) is torch.optim.AdamW
    assert {k: adamw.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")} == {
        "lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01, "amsgrad": False}
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam  # L2 decay, as DeepSpeed's
    assert type(DeepSpeedCPUAdagrad(params, lr=0.5)) is torch.optim.Adagrad
    with pytest.raises(ValueError, match="bias_correction=True"):
        DeepSpeedCPUAdam(params, bias_correction=False)


@pytest.mark.unit
def test_amsgrad_and_no_bias_correction_are_refused_as_argument_and_per_group():
    """DeepSpeed's `add_param_group` raises for a group's (or the default) amsgrad; its kernel reads
    `bias_correction` per group, which torch cannot do."""
    weight, bias = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant.*use amsgrad=False"):
        DeepSpeedCPUAdam([weight], amsgrad=True)
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        DeepSpeedCPUAdam([{"params": [weight]}, {"params": [bias], "amsgrad": True}])
    with pytest.raises(ValueError, match="group's 'bias_correction'.*use bias_correction=True"):
        DeepSpeedCPUAdam([{"params": [weight]}, {"params": [bias], "bias_correction": False}], adamw_mode=False)
    # a group may say amsgrad False / bias_correction True, as DeepSpeed's defaults
    opt = DeepSpeedCPUAdam(iter([{"params": [weight], "amsgrad": False, "bias_correction": True}]))
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["amsgrad"] is False


@pytest.mark.unit
def test_adagrad_takes_and_ignores_amsgrad_as_deepspeeds_does():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = DeepSpeedCPUAdagrad(params, lr=0.5, amsgrad=True)
    assert type(opt) is torch.optim.Adagrad and opt.defaults["lr"] == 0.5


@pytest.mark.unit
def test_the_served_modules_hold_deepspeeds_names_and_refuse_the_rest_by_name():
    from zerodist.runtime.ops import adagrad, adam

    assert adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam and adagrad.DeepSpeedCPUAdagrad is DeepSpeedCPUAdagrad
    assert not hasattr(adagrad, "DeepSpeedCPUAdam") and not hasattr(adam, "DeepSpeedCPUAdagrad")
    with pytest.raises(ImportError, match="served by zerodist.*use a torch optimizer"):
        from zerodist.runtime.ops.adam import FusedAdam  # noqa: F401
    with pytest.raises(AttributeError, match="only DeepSpeedCPUAdagrad"):
        adagrad.Whatever  # noqa: B018


@pytest.mark.multiprocess
def test_accelerates_offload_swap_gets_torchs_optimizer_with_the_same_groups_and_steps():
    pytest.importorskip("accelerate")
    result = served_python("""
        import copy, torch
        from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

        def groups(m):  # a Trainer's two groups: decayed weights, undecayed biases
            return [{"params": [m[0].weight, m[1].weight], "weight_decay": 0.1},
                    {"params": [m[0].bias, m[1].bias], "weight_decay": 0.0}]

        cases = [(torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6)),
                 (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6)),
                 (torch.optim.Adagrad, dict(lr=1e-2, eps=1e-9))]
        for torch_class, kwargs in cases:
            ours, theirs = model(), model()
            mapped = map_pytorch_optim_to_deepspeed(torch_class(groups(ours), **kwargs))
            reference = torch_class(groups(theirs), **kwargs)
            assert type(mapped) is torch_class, (torch_class, type(mapped))
            for a, b in zip(mapped.param_groups, reference.param_groups):
                assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
            for step in range(3):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                for m, opt in ((ours, mapped), (theirs, reference)):
                    opt.zero_grad()
                    m(x).square().mean().backward()
                    opt.step()
            assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters())), torch_class

        import zerodist.runtime.ops
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        assert DeepSpeedCPUAdam is zerodist.runtime.ops.DeepSpeedCPUAdam
        import deepspeed.ops.adagrad
        assert not hasattr(deepspeed.ops.adagrad, "DeepSpeedCPUAdam")  # DeepSpeed's has only DeepSpeedCPUAdagrad
        try:
            from deepspeed.ops.adam import FusedAdam
        except ImportError as error:
            assert "served by zerodist" in str(error) and "use a torch optimizer" in str(error), error
        else:
            raise AssertionError("FusedAdam")
        for missing in ("deepspeed.ops.transformer", "deepspeed.ops.lion"):  # the kernels stay refused, by name
            try:
                __import__(missing)
            except ModuleNotFoundError as error:
                assert "served by zerodist" in str(error) and error.name == missing, error
            else:
                raise AssertionError(missing)
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
    assert "DeepSpeedCPUAdam (DeepSpeed's CPU kernel" in result.stderr
