"""The update rules of the sync-free optimizers, written as torch.optim's single-tensor
rules with every result selected by `found_inf` (kept where it is non-zero)."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor


def _keep(skip: Tensor, old: Tensor, new: Tensor) -> None:
    old.copy_(torch.where(skip, old, new))


def sgd_step(found_inf: Tensor, state_steps: List[Tensor], params: List[Tensor], d_p_list: List[Tensor],
             momentum_buffer_list: List[Optional[Tensor]], *, weight_decay: float, momentum: float,
             lr: float, dampening: float, nesterov: bool, maximize: bool) -> None:
    """SGD; a momentum buffer starts as the first gradient of a step that is not skipped."""
    skip = found_inf != 0
    for i, param in enumerate(params):
        d_p = d_p_list[i] if not maximize else -d_p_list[i]
        step = state_steps[i]
        if weight_decay != 0:
            d_p = d_p.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffer_list[i]
            if buf is None:
                buf = torch.zeros_like(param, memory_format=torch.preserve_format)
                momentum_buffer_list[i] = buf
            new_buf = torch.where(step == 0, d_p, buf.mul(momentum).add(d_p, alpha=1 - dampening))
            d_p = d_p.add(new_buf, alpha=momentum) if nesterov else new_buf
            _keep(skip, buf, new_buf)
        _keep(skip, param, param.add(d_p, alpha=-lr))
        _keep(skip, step, step + 1)


def adam_step(found_inf: Tensor, state_steps: List[Tensor], params: List[Tensor], grads: List[Tensor],
              exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], max_exp_avg_sqs: List[Tensor], *,
              amsgrad: bool, beta1: float, beta2: float, lr: float, weight_decay: float, eps: float,
              maximize: bool, use_adamw: bool) -> None:
    """Adam (AdamW with `use_adamw`: decoupled weight decay); bias corrections from the
    device step count, which counts only the steps that were not skipped."""
    skip = found_inf != 0
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t = state_steps[i]
        new_step = step_t + 1
        new_param = param
        if weight_decay != 0:
            if use_adamw:
                new_param = param.mul(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg = exp_avgs[i].lerp(grad, 1 - beta1)
        exp_avg_sq = exp_avg_sqs[i].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - torch.pow(beta1, new_step)
        bias_correction2_sqrt = (1 - torch.pow(beta2, new_step)).sqrt()
        step_size = lr / bias_correction1
        if amsgrad:
            max_sq = torch.maximum(max_exp_avg_sqs[i], exp_avg_sq)
            denom = (max_sq.sqrt() / bias_correction2_sqrt).add(eps)
            _keep(skip, max_exp_avg_sqs[i], max_sq)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
        new_param = new_param + (-step_size) * (exp_avg / denom)
        _keep(skip, param, new_param)
        _keep(skip, exp_avgs[i], exp_avg)
        _keep(skip, exp_avg_sqs[i], exp_avg_sq)
        _keep(skip, step_t, new_step)
