"""Inputs shared by the SSD kernel tests."""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.mamba2 import schedule as scheduling
from pallas_kernels.mamba2 import tuning, walks

DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_inputs(seed, *, b=2, t=37, h=4, p=8, n=16, g=2, dtype=jnp.float32, d="hp", z=True,
                dt_bias=True, initial_states=True, seq_idx=False):
    """Random SSD arguments (mamba_ssm names); `d` is None, "h" or "hp" (the shape of D)."""
    k = jax.random.split(jax.random.key(seed), 10)
    args = dict(
        x=jax.random.normal(k[0], (b, t, h, p), dtype),
        dt=(jax.random.normal(k[1], (b, t, h)) * 0.7 - 1.0).astype(dtype),
        A=-jnp.exp(jax.random.uniform(k[2], (h,), minval=-1.0, maxval=1.5)),
        B=jax.random.normal(k[3], (b, t, g, n), dtype),
        C=jax.random.normal(k[4], (b, t, g, n), dtype),
        D=None if d is None else jax.random.normal(k[5], (h,) if d == "h" else (h, p)),
        z=jax.random.normal(k[6], (b, t, h, p), dtype) if z else None,
        dt_bias=jax.random.normal(k[7], (h,)) * 0.3 if dt_bias else None,
        initial_states=jax.random.normal(k[8], (b, h, p, n)) if initial_states else None,
        seq_idx=None,
    )
    if seq_idx:
        # Row 0: boundaries at random places (inside chunks); row 1: one sequence.
        ids = jnp.sort(jax.random.randint(k[9], (t,), 0, 4)).astype(jnp.int32)
        args["seq_idx"] = jnp.stack([ids] + [jnp.zeros(t, jnp.int32)] * (b - 1))
    return args


def loss_and_grads(fn, args, **kw):
    """((y, final), grads) of sum(y * w) + sum(final * v) w.r.t. every array argument given."""
    names = [n for n in DIFFERENTIABLE if args.get(n) is not None]
    fixed = {k: v for k, v in args.items() if k not in names}

    def loss(*values):
        y, final = fn(**dict(zip(names, values, strict=True)), **fixed, return_final_states=True,
                      **kw)
        w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
        v = jnp.sin(jnp.arange(final.size, dtype=jnp.float32).reshape(final.shape))
        return jnp.sum(y.astype(jnp.float32) * w) + jnp.sum(final * v), (y, final)

    values = [args[n] for n in names]
    # jit: one compile of the whole step instead of op-by-op dispatch (much faster on a CPU).
    (_, outs), grads = jax.jit(jax.value_and_grad(
        loss, argnums=tuple(range(len(names))), has_aux=True))(*values)
    return outs, dict(zip(names, grads, strict=True))


def force_cut_walks(monkeypatch, schedule, backward_split=True):
    """Makes the scan kernels cut their walks at a small size: the forward by `schedule`, the
    backward's into units of 2 chunks (or not at all without `backward_split`). Returns the
    list that collects (kind, schedule) of every `walks.unit_sums` call."""
    table = tuning.blocks_for
    monkeypatch.setattr(tuning, "blocks_for", lambda kind, n: dataclasses.replace(
        table(kind, n), scan_programs=10**6, min_segment_chunks=2,
        backward_segment_walks_below=10**6 if backward_split else 0))
    monkeypatch.setattr(scheduling, "forward_schedule", lambda *a: schedule)
    calls = []
    unit_sums = walks.unit_sums
    monkeypatch.setattr(walks, "unit_sums",
                        lambda *a, plan, kind, **kw: calls.append((kind, plan.schedule))
                        or unit_sums(*a, plan=plan, kind=kind, **kw))
    return calls
