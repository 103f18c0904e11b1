"""A second oracle for raydeep's compressed-communication optimizers: DeepSpeed's own 1-bit Adam,
0/1 Adam and 1-bit LAMB, transcribed per rank, for ``world`` simulated workers in one process.

Transcribed from (the files are gone from DeepSpeed 0.19.8):

- ``deepspeed/runtime/fp16/onebit/adam.py``   ``OnebitAdam.step``   microsoft/DeepSpeed@06fa7eea772a
- ``deepspeed/runtime/fp16/onebit/zoadam.py`` ``ZeroOneAdam.step``  microsoft/DeepSpeed@0c3d46e3df7a
- ``deepspeed/runtime/fp16/onebit/lamb.py``   ``OnebitLamb.step``   deepspeedai/DeepSpeed@768f08d113c9
  (same algorithm as microsoft/DeepSpeed@0a849d56997753)
- ``deepspeed/runtime/comm/nccl.py``          ``NcclBackend.compressed_allreduce`` microsoft/DeepSpeed@0bc57183e4ab
  (``comm/compressed.py``, deepspeedai/DeepSpeed@2fd914ca47da, is the same arithmetic with its own
  packbits kernel) and ``runtime/compression/cupy.py`` ``compress_by_chunk``.

Nothing here comes from ``raydeep.compression``. The structure is DeepSpeed's, so the code can be
read next to it: each rank runs its own ``step`` with DeepSpeed's state names (``exp_avg``,
``exp_avg_sq``, ``worker_error``, ``server_error``, ``var_interval``, ``var_counter``,
``local_step_interval``, ``local_step_counter``, ``lrs``, ``momentum_accumulator``,
``lamb_coeff_freeze``, ``last_factor``, ``scaling_coeff``, ``exp_avg_sq_fresh``, ``exp_avg_flat``,
``dummy_exp_avg``), its flags (``initialize``, ``adam_freeze_key``, ``freeze_key``,
``reinitial_error_buffer``, ``lamb_freeze_key``) and its engine switch
(``enable_backward_allreduce``). Each ``step`` is a generator that yields at every collective;
``_lockstep`` runs all ranks' generators side by side and serves the collectives from plain lists
(rank ``r``'s tensor at index ``r``): ``all_to_all_single`` hands rank ``r`` the ``r``-th row of
every rank, ``all_gather`` hands every rank every rank's tensor.

The engine around the optimizer is DeepSpeed's too, reduced to what matters here: a step's
gradients are the exact average (rank-order sum times ``1/world``) when the rank's
``enable_backward_allreduce`` is True (it starts True and the optimizers switch it), else each
worker's own.

Departures from DeepSpeed (none changes the arithmetic of a supported path):

- numpy's ``packbits``/``unpackbits`` in place of cupy's (same MSB-first bit order, same bool
  input ``sign().add_(1).bool()``, which maps 0 and -0 to +1);
- no fp16 wrapper (``FP16_Optimizer`` flattened each param group into one tensor; here, as under
  fp32 in DeepSpeed, every parameter is its own tensor), one param group, no ``closure``, no
  loss scaling, no gradient clipping, no ``max_grad_norm``, no ``eps_inside_sqrt``;
- ``exp_avg_mask`` and the ``non_freeze`` group flag are not supported (a param group never has them);
- no pipeline engine (``pipeline_enable_backward_allreduce``), no checkpoint loading, no prints.

``grad_fn(step, rank, params)`` gives worker ``rank``'s gradients (one tensor per parameter) at
``step`` (1-based) for that worker's own parameters. Each function returns rank 0's parameters
after every step.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

GradFn = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]


# --- the process group: lists in lockstep -------------------------------------------------------
def _all_to_all_single(sends: list[np.ndarray]) -> list[np.ndarray]:
    world = len(sends)
    return [np.stack([sends[j][r] for j in range(world)]) for r in range(world)]


def _all_gather(sends: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in sends] for _ in sends]


_COLLECTIVES = {"all_to_all_single": _all_to_all_single, "all_gather": _all_gather}


def _lockstep(gens: list) -> list:
    """Run one generator per rank until all return; every yield is ``(collective, tensor)`` and
    every rank must yield the same collective at the same point."""
    replies = [None] * len(gens)
    while True:
        requests, results, finished = [], [None] * len(gens), 0
        for r, gen in enumerate(gens):
            try:
                requests.append(gen.send(replies[r]))
            except StopIteration as stop:
                results[r], finished = stop.value, finished + 1
                requests.append(None)
        if finished == len(gens):
            return results
        kinds = {q[0] if q else None for q in requests}
        if finished or len(kinds) != 1:
            raise RuntimeError(f"ranks out of step: {kinds}")
        replies = _COLLECTIVES[kinds.pop()]([q[1] for q in requests])


# --- NcclBackend.compressed_allreduce ---------------------------------------------------------------
def _sign01(t: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's +-1: ``sign().add_(1).bool().float().add_(-0.5).mul_(2.0)`` (0 goes to +1)."""
    return t.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)


def _compress_by_chunk(bits: torch.Tensor, num_chunks: int) -> list[np.ndarray]:
    packed_sign = np.packbits(bits.numpy())
    return np.split(packed_sign, num_chunks)


def _unpack(rows: np.ndarray, size: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(rows.flatten()).reshape(size, -1).copy()).float().add_(-0.5).mul_(2.0)


def compressed_allreduce(buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         size: int):
    """One rank's side of DeepSpeed's compressed all-reduce (a generator: yields its collectives).
    As in DeepSpeed, an unpadded 1-D ``buffer_m`` is overwritten in place and returned."""
    original_shape = buffer_m.size()
    if len(original_shape) > 1:
        buffer_m = torch.flatten(buffer_m)
    original_size = buffer_m.numel()
    worker_error_size = worker_error.numel()
    if original_size != worker_error_size:
        empty_tensor = torch.zeros(worker_error_size - original_size, device=buffer_m.device)
        buffer_m = torch.cat([buffer_m, empty_tensor])

    # worker side
    buffer_m.add_(worker_error)
    worker_scale = torch.norm(buffer_m) / np.sqrt(torch.numel(buffer_m))
    worker_error.set_(buffer_m - worker_scale * _sign01(buffer_m))
    sign_list_packed = _compress_by_chunk(buffer_m.sign_().add_(1).bool(), size)

    # phase 1: signs all-to-all, scales all-gathered
    recvbuf_sign = yield ("all_to_all_single", np.stack(sign_list_packed))
    recvbuf_scale = yield ("all_gather", worker_scale.reshape(1))

    # server side: this rank's chunk of every worker
    compensated_server_m = _unpack(recvbuf_sign, size).mul_(torch.stack(recvbuf_scale).mul_(1 / size)).sum(0)
    compensated_server_m.add_(server_error)
    server_scale = torch.norm(compensated_server_m) / np.sqrt(compensated_server_m.numel())
    server_error.set_(compensated_server_m - server_scale * _sign01(compensated_server_m))
    server_sign_packed = _compress_by_chunk(compensated_server_m.sign_().add_(1).bool(), 1)

    # phase 2: every server chunk's signs and scale to everyone
    recvbuf_sign_server = yield ("all_gather", torch.from_numpy(server_sign_packed[0].copy()))
    recvbuf_scale_server = yield ("all_gather", server_scale.reshape(1))
    recvbuf_sign_server = torch.stack(recvbuf_sign_server).numpy()

    buffer_m.data.copy_(_unpack(recvbuf_sign_server, size).mul_(torch.stack(recvbuf_scale_server)).flatten().data)
    if original_size != worker_error_size:
        buffer_m = buffer_m[0:original_size]
    if len(original_shape) > 1:
        buffer_m = buffer_m.reshape(original_shape)
    return buffer_m


# --- the engine --------------------------------------------------------------------------------------
class _Engine:
    """What the optimizers see of DeepSpeed's engine: the switch for the gradient all-reduce."""

    def __init__(self):
        self.enable_backward_allreduce = True


def _divider(size: int) -> int:
    return int(size * 8 / np.gcd(size, 8))


def _train(make_optimizer, params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int):
    """Each rank holds its own parameters, engine and optimizer; per step the engine hands the
    averaged or the local gradients to ``step``, and all ranks' steps run in lockstep."""
    ranks = []
    for r in range(world):
        rank_params = [p.detach().clone().float() for p in params]
        engine = _Engine()
        ranks.append((rank_params, engine, make_optimizer(rank_params, engine, r)))
    history = []
    for step in range(1, steps + 1):
        local = [grad_fn(step, r, ranks[r][0]) for r in range(world)]
        grads = []
        for r, (_, engine, _) in enumerate(ranks):
            if engine.enable_backward_allreduce:  # the exact average: rank-order sum times 1/world
                averaged = []
                for i in range(len(params)):
                    total = local[0][i].clone().float()
                    for other in local[1:]:
                        total += other[i]
                    averaged.append(total.mul_(1.0 / world))
                grads.append(averaged)
            else:
                grads.append([g.clone().float() for g in local[r]])
        # DeepSpeed's steps yield inside ``torch.no_grad()`` blocks; interleaved generators would
        # restore each other's grad mode (leaving it off for the rest of the process), so the
        # whole lock-stepped update runs with grad mode already off.
        with torch.no_grad():
            _lockstep([opt.step(grads[r]) for r, (_, _, opt) in enumerate(ranks)])
        history.append([p.clone() for p in ranks[0][0]])
    return history


class _Optimizer:
    def __init__(self, params, engine, rank, size, lr, betas, eps, weight_decay):
        self.params, self.deepspeed, self.rank, self.size = params, engine, rank, size
        self.group = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.state = [dict() for _ in params]
        self.initialize = False
        self.divider = _divider(size)

    def _allreduce(self, buffer_m, worker_error, server_error):
        return compressed_allreduce(buffer_m, worker_error, server_error, self.size)


# --- OnebitAdam.step -----------------------------------------------------------------------------------
class OnebitAdam(_Optimizer):
    def __init__(self, params, engine, rank, size, *, lr, freeze_step, betas, eps, weight_decay):
        super().__init__(params, engine, rank, size, lr, betas, eps, weight_decay)
        self.freeze_step = freeze_step
        self.adam_freeze_key = False

    def step(self, grads):
        group = self.group
        state = None
        for i, (p, grad) in enumerate(zip(self.params, grads)):
            state = self.state[i]
            if len(state) == 0:
                state['step'] = 0
                state['exp_avg'] = torch.zeros_like(p.data)
                state['exp_avg_sq'] = torch.zeros_like(p.data)
            if not self.initialize or (self.adam_freeze_key and 'worker_error' not in state.keys()):
                state['tensor_size'] = torch.numel(p.data)
                state['corrected_tensor_size'] = state['tensor_size']
                if state['tensor_size'] % (self.size * self.divider) != 0:
                    state['corrected_tensor_size'] += ((self.size * self.divider) -
                                                       (state['tensor_size'] % (self.size * self.divider)))
                state['server_chunk_size'] = state['corrected_tensor_size'] // self.size
                state['worker_error'] = torch.zeros(state['corrected_tensor_size'], device=p.device)
                state['server_error'] = torch.zeros(state['server_chunk_size'], device=p.device)
                self.adam_freeze_key = True

            exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
            beta1, beta2 = group['betas']
            state['step'] += 1

            if self.adam_freeze_key is False:
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                grad = None
                if self.initialize:
                    update = exp_avg / (exp_avg_sq.sqrt() + group['eps'])
            else:
                if self.initialize is True:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                grad = None
                if self.size > 1:
                    exp_avg.set_((yield from self._allreduce(exp_avg, state['worker_error'], state['server_error'])))
                if self.initialize:
                    update = exp_avg / (exp_avg_sq.sqrt() + group['eps'])

            if self.initialize:
                if group['weight_decay'] > 0.0:
                    update += group['weight_decay'] * p.data
                with torch.no_grad():
                    p.add_(-group['lr'] * update)

        if not self.initialize:  # DeepSpeed pops the errors of the group's last parameter only
            state.pop('worker_error')
            state.pop('server_error')
            self.adam_freeze_key = False
            self.initialize = True
            return

        if self.adam_freeze_key is False:
            if state['step'] >= self.freeze_step:
                self.adam_freeze_key = True
                self.deepspeed.enable_backward_allreduce = False


# --- ZeroOneAdam.step ----------------------------------------------------------------------------------
class ZeroOneAdam(_Optimizer):
    def __init__(self, params, engine, rank, size, *, lr, var_freeze_step, var_update_scaler, local_step_scaler,
                 local_step_clipper, betas, eps, weight_decay):
        super().__init__(params, engine, rank, size, lr, betas, eps, weight_decay)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.freeze_key = False
        self.reinitial_error_buffer = False

    def step(self, grads):
        group = self.group
        state = None
        for i, (p, grad) in enumerate(zip(self.params, grads)):
            state = self.state[i]
            if len(state) == 0:
                state['step'] = 0
                state['exp_avg'] = torch.zeros_like(p.data)
                state['exp_avg_sq'] = torch.zeros_like(p.data)
            if not self.initialize or 'worker_error' not in state.keys():
                state['var_interval'] = 1
                state['var_counter'] = 0
                state['local_step_interval'] = 1
                state['local_step_counter'] = 0
                state['lrs'] = 0
                state['tensor_size'] = torch.numel(p.data)
                state['corrected_tensor_size'] = state['tensor_size']
                if state['tensor_size'] % (self.size * self.divider) != 0:
                    state['corrected_tensor_size'] += ((self.size * self.divider) -
                                                       (state['tensor_size'] % (self.size * self.divider)))
                state['server_chunk_size'] = state['corrected_tensor_size'] // self.size
                state['worker_error'] = torch.zeros(state['corrected_tensor_size'], device=p.device)
                state['server_error'] = torch.zeros(state['server_chunk_size'], device=p.device)
                state['momentum_accumulator'] = torch.zeros_like(p.data)  # u in the 0/1 Adam paper

            exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
            comm_buffer = state['momentum_accumulator']
            beta1, beta2 = group['betas']
            state['step'] += 1

            if self.initialize:
                if self.freeze_key is False:
                    if state['step'] % state['var_interval'] == 0:
                        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    else:
                        if self.size > 1:
                            with torch.no_grad():
                                grad_onebit = yield from self._allreduce(grad, state['worker_error'],
                                                                         state['server_error'])
                                exp_avg.mul_(beta1).add_(grad_onebit, alpha=1 - beta1)
                else:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    state['lrs'] += group['lr']
                grad = None

            if not self.initialize:
                if self.size > 1:
                    comm_buffer.set_((yield from self._allreduce(comm_buffer, state['worker_error'],
                                                                 state['server_error'])))

            if self.initialize:
                update = exp_avg / (exp_avg_sq.sqrt() + group['eps'])
                if group['weight_decay'] > 0.0:
                    update += group['weight_decay'] * p.data
                with torch.no_grad():
                    p.data.add_(-group['lr'] * update)
                    if self.freeze_key is True:
                        comm_buffer.add_(-group['lr'] * update)
                if state['step'] % state['local_step_interval'] == 0 and self.freeze_key:
                    with torch.no_grad():
                        p.data.add_(-1 * comm_buffer)
                        comm_buffer.mul_(exp_avg_sq.sqrt() + group['eps'])
                        if self.size > 1:
                            comm_buffer.copy_((yield from self._allreduce(comm_buffer, state['worker_error'],
                                                                          state['server_error'])))
                        exp_avg.zero_().add_(comm_buffer / state['lrs'], alpha=-1)
                        p.data.add_(comm_buffer / (exp_avg_sq.sqrt() + group['eps']))
                        comm_buffer.zero_()
                        state['lrs'] = 0

                if self.freeze_key is False:
                    if state['step'] % state['var_interval'] == 0:
                        state['var_counter'] += 1
                        if state['var_counter'] == self.var_update_scaler:
                            state['var_counter'] = 0
                            state['var_interval'] *= 2
                    # the next step's gradient is all-reduced only if it refreshes the variance
                    self.deepspeed.enable_backward_allreduce = (state['step'] + 1) % state['var_interval'] == 0
                else:
                    state['local_step_counter'] += 1
                    if state['local_step_counter'] == self.local_step_scaler:
                        state['local_step_counter'] = 0
                        state['local_step_interval'] = min(self.local_step_clipper,
                                                           state['local_step_interval'] * 2)

        if not self.initialize:  # DeepSpeed pops the errors of the group's last parameter only
            self.freeze_key = False
            state.pop('worker_error')
            state.pop('server_error')
            self.initialize = True
            return

        if self.state[0]['step'] > self.var_freeze_step:
            self.freeze_key = True
            self.deepspeed.enable_backward_allreduce = False

        if self.freeze_key is True and self.reinitial_error_buffer is False:
            # the errors now measure accumulated momentum, not gradients: start them from zero
            for s in self.state:
                s['worker_error'].zero_()
                s['server_error'].zero_()
            self.reinitial_error_buffer = True


# --- OnebitLamb.step -----------------------------------------------------------------------------------
class OnebitLamb(_Optimizer):
    def __init__(self, params, engine, rank, size, *, lr, freeze_step, betas, eps, weight_decay, max_coeff,
                 min_coeff, coeff_beta, factor_max, factor_min, factor_threshold):
        super().__init__(params, engine, rank, size, lr, betas, eps, weight_decay)
        self.group.update(max_coeff=max_coeff, min_coeff=min_coeff)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_freeze_key = False
        self.exp_avg_flat, self.dummy_exp_avg = [], {}
        self.corrected_tensor_sizes, self.server_chunk_sizes = [], []
        self.worker_errors, self.server_errors = [], []
        self.lamb_coeffs = []

    def step(self, grads):
        group = self.group
        del self.lamb_coeffs[:]

        if self.lamb_freeze_key:
            exp_avg_last_step = [self.state[j]['exp_avg'].detach().clone() for j in range(len(self.params))]
            if 'scaling_coeff' not in self.state[0]:
                # each momentum's RMS against their mean, fixed at the end of the warm-up
                momentum_scales = [(torch.linalg.vector_norm(s['exp_avg']) / np.sqrt(torch.numel(s['exp_avg']))).item()
                                   for s in self.state]
                united_scale = sum(momentum_scales) / len(momentum_scales)
                for j, s in enumerate(self.state):
                    s['scaling_coeff'] = united_scale / momentum_scales[j]

        state = None
        for i, (p, grad) in enumerate(zip(self.params, grads)):
            state = self.state[i]
            if len(state) == 0 or (len(state) == 1 and 'scaling_coeff' in state.keys()):
                state['step'] = 0
                state['lamb_coeff_freeze'] = 0.0
                state['last_factor'] = 1.0
                state['exp_avg'] = torch.zeros_like(p.data)
                state['exp_avg_sq'] = torch.zeros_like(p.data)
                state['exp_avg_sq_fresh'] = torch.zeros_like(p.data)
            if not self.initialize:
                self.lamb_freeze_key = True

            exp_avg, exp_avg_sq, exp_avg_sq_fresh = state['exp_avg'], state['exp_avg_sq'], state['exp_avg_sq_fresh']
            beta1, beta2 = group['betas']
            max_coeff, min_coeff = group['max_coeff'], group['min_coeff']
            state['step'] += 1

            if self.lamb_freeze_key is False:  # warm-up: LAMB on the exact average
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if state['step'] == self.freeze_step:
                    exp_avg_sq_fresh.data = exp_avg_sq.detach().clone()
                grad = None
                if self.initialize:
                    weight_norm = p.data.pow(2).sum().sqrt()
                    update = exp_avg / (exp_avg_sq.sqrt() + group['eps'])
                    if group['weight_decay'] > 0.0:
                        update += group['weight_decay'] * p.data
                    update_norm = update.pow(2).sum().sqrt()
                    lamb_coeff = 1.0
                    if weight_norm != 0 and update_norm != 0:
                        lamb_coeff = (weight_norm / update_norm).item()
                        if lamb_coeff > max_coeff:
                            lamb_coeff = max_coeff
                        if lamb_coeff < min_coeff:
                            lamb_coeff = min_coeff
                    if lamb_coeff != 1.0:
                        state['lamb_coeff_freeze'] = self.coeff_beta * state['lamb_coeff_freeze'] + (
                            1 - self.coeff_beta) * lamb_coeff
                    self.lamb_coeffs.append(lamb_coeff)
                    with torch.no_grad():
                        p.add_(-group['lr'] * lamb_coeff * update)
            else:  # compression stage: the local momentum, scaled; communicated fused below
                if self.initialize:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    exp_avg.mul_(self.state[i]['scaling_coeff'])
                grad = None

        # the fused momentum: every parameter's exp_avg becomes a view of one flat tensor
        if len(self.exp_avg_flat) == 0:
            momentum_groups, tensor_size = [], 0
            for j, p in enumerate(self.params):
                momentum_groups.append(self.state[j]['exp_avg'])
                tensor_size += torch.numel(p.data)
            corrected_tensor_size = tensor_size
            if tensor_size % (self.size * self.divider) != 0:
                difference = (self.size * self.divider) - (tensor_size % (self.size * self.divider))
                corrected_tensor_size += difference
                self.dummy_exp_avg[0] = torch.zeros(difference, device=momentum_groups[0].data.device)
                momentum_groups.append(self.dummy_exp_avg[0])
            self.corrected_tensor_sizes.append(corrected_tensor_size)
            self.server_chunk_sizes.append(corrected_tensor_size // self.size)
            self.exp_avg_flat.append(_flatten_dense_tensors([m.detach().clone() for m in momentum_groups]))
            updated_params = _unflatten_dense_tensors(self.exp_avg_flat[0], momentum_groups)
            for m, q in zip(momentum_groups, updated_params):
                m.data = q.data

        if self.initialize and len(self.worker_errors) == 0:
            for i in range(len(self.exp_avg_flat)):
                self.worker_errors.append(torch.zeros(self.corrected_tensor_sizes[i]))
                self.server_errors.append(torch.zeros(self.server_chunk_sizes[i]))

        if self.lamb_freeze_key:
            if self.size > 1:
                for i in range(len(self.exp_avg_flat)):
                    if not self.initialize:
                        self.worker_errors.append(torch.zeros(self.corrected_tensor_sizes[i]))
                        self.server_errors.append(torch.zeros(self.server_chunk_sizes[i]))
                        yield from self._allreduce(self.exp_avg_flat[i], self.worker_errors[0], self.server_errors[0])
                        del self.worker_errors[:]
                        del self.server_errors[:]
                    else:  # in place: exp_avg_flat (and every exp_avg) now holds the decoded average
                        yield from self._allreduce(self.exp_avg_flat[i], self.worker_errors[i], self.server_errors[i])

        if self.lamb_freeze_key and self.initialize:
            for j, p in enumerate(self.params):
                state = self.state[j]
                exp_avg, exp_avg_sq, exp_avg_sq_fresh = state['exp_avg'], state['exp_avg_sq'], state['exp_avg_sq_fresh']
                beta1, beta2 = group['betas']
                exp_avg.div_(self.state[j]['scaling_coeff'])
                grad_reconstruct = ((exp_avg - exp_avg_last_step[j] * beta1) / (1 - beta1))
                exp_avg_sq_fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
                denom = exp_avg_sq.sqrt() + group['eps']
                update_prelim = exp_avg / denom
                if group['weight_decay'] > 0.0:
                    update = update_prelim + group['weight_decay'] * p.data
                else:
                    update = update_prelim
                lamb_coeff = 1.0
                update_norm = update.pow(2).sum().sqrt()
                denom_real = exp_avg_sq_fresh.sqrt() + group['eps']
                factor = (denom / denom_real).max().item()
                if group['weight_decay'] > 0.0:
                    update_ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                    factor = factor * update_ratio + (1.0 - update_ratio)
                if factor > self.factor_max:
                    factor = self.factor_max
                if factor < self.factor_min:
                    factor = self.factor_min
                if factor > state['last_factor'] * (1.0 + self.factor_threshold):
                    factor = state['last_factor'] * (1.0 + self.factor_threshold)
                if factor < state['last_factor'] * (1.0 - self.factor_threshold):
                    factor = state['last_factor'] * (1.0 - self.factor_threshold)
                state['last_factor'] = factor
                lamb_coeff = state['lamb_coeff_freeze'] * factor
                self.lamb_coeffs.append(lamb_coeff)
                with torch.no_grad():
                    p.add_(-group['lr'] * lamb_coeff * update)

        if not self.initialize:
            self.lamb_freeze_key = False
            self.initialize = True
            return

        if self.lamb_freeze_key is False:
            if state['step'] >= self.freeze_step:
                self.lamb_freeze_key = True
                self.deepspeed.enable_backward_allreduce = False


# --- the interface of raydeep.compression.reference ------------------------------------------------------
def onebit_adam(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
                ) -> list[list[torch.Tensor]]:
    """DeepSpeed's 1-bit Adam on ``world`` workers; rank 0's parameters after every step."""
    return _train(lambda ps, engine, r: OnebitAdam(ps, engine, r, world, lr=lr, freeze_step=freeze_step, betas=betas,
                                                   eps=eps, weight_decay=weight_decay),
                  params, grad_fn, steps, world)


def zero_one_adam(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                  var_freeze_step: int, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
                  ) -> list[list[torch.Tensor]]:
    """DeepSpeed's 0/1 Adam on ``world`` workers; rank 0's parameters after every step."""
    return _train(lambda ps, engine, r: ZeroOneAdam(ps, engine, r, world, lr=lr, var_freeze_step=var_freeze_step,
                                                    var_update_scaler=var_update_scaler,
                                                    local_step_scaler=local_step_scaler,
                                                    local_step_clipper=local_step_clipper, betas=betas, eps=eps,
                                                    weight_decay=weight_decay),
                  params, grad_fn, steps, world)


def onebit_lamb(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0,
                factor_min: float = 0.5, factor_threshold: float = 0.1
                ) -> list[list[torch.Tensor]]:
    """DeepSpeed's 1-bit LAMB on ``world`` workers (each parameter a layer; all momenta fused
    into one compressed tensor); rank 0's parameters after every step."""
    return _train(lambda ps, engine, r: OnebitLamb(ps, engine, r, world, lr=lr, freeze_step=freeze_step, betas=betas,
                                                   eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                                                   min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                                                   factor_min=factor_min, factor_threshold=factor_threshold),
                  params, grad_fn, steps, world)
