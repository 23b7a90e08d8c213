"""Context parallelism for attention: the query, key and value sequences sharded over a mesh
axis of n devices (`_sharding` describes the two token orders).

Each device computes the output rows of its own queries at their global positions. Its
queries and keys are cut into the pieces of their shards (one piece each in contiguous order,
two in zig-zag order). Each (query piece, key piece) pair runs as one call whose band is
shifted by the pieces' global offsets (`masking`'s shift), so causal masks, windows, segments,
lengths and the soft cap mean what they mean on the whole sequence. Two strategies:

* "all_gather" gathers K, V and the key segment ids into natural order and runs each query
  piece against all of them; the gradients of K and V come back through the gather's
  transpose, a reduce-scatter.
* "ring" keeps K and V in shards. In n steps each device works on the key shard of device
  i - step while passing it on to device i + 1 (a collective-permute issued before the step's
  kernels, so it overlaps them), merging the partial outputs by their log-sum-exps. Its
  backward (a custom_vjp) goes round again with the global lse and delta, so each pair's
  kernels give exact partial gradients; dK and dV travel with their shard and arrive home
  after the n-th pass. Residuals stay shard-sized. With kernels (`gradients` given) the
  backward runs them; on the xla path (`gradients` None) autodiff differentiates the forward.

Each strategy is `fn(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg,
q_len, kv_len) -> (out (B, Tl, N, H), lse (B, Tl, N))` on one device's shards (Tl = T / parts
tokens), where `compute(q, k, v, q_seg, kv_seg, q_len, kv_len, shift) -> (out, lse)` and
`gradients(q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout, lse, delta) -> (dq, dk, dv)`
work on local pieces; lengths (B,) count global positions, as given to the op.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _sharding
from pallas_kernels.attention import common


def all_gather(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
               kv_len):
    """The "all_gather" strategy (see the module docstring)."""
    del gradients  # the pieces' own custom_vjps differentiate, through the gather
    index = jax.lax.axis_index(axis_name)
    k, v, kv_seg = (_sharding.gather_sequence(x, axis_name, order, parts)
                    for x in (k, v, kv_seg))
    pieces = []
    for start, size, offset in _sharding.local_chunks(order, parts, index, q.shape[1]):
        pieces.append(compute(_piece(q, start, size), k, v, _piece(q_seg, start, size), kv_seg,
                              _local_length(q_len, offset, size), kv_len, -offset))
    return tuple(jnp.concatenate(p, axis=1) for p in zip(*pieces, strict=True))


def ring(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len, kv_len):
    """The "ring" strategy (see the module docstring)."""
    if gradients is None:
        return _ring_forward(compute, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
                             kv_len)
    return _ring(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
                 kv_len)


STRATEGIES = {"all_gather": all_gather, "ring": ring}


def strategy(name):
    """The strategy function called `name` (the `context_parallelism` argument)."""
    if name not in STRATEGIES:
        raise ValueError(f"context_parallelism must be one of {tuple(STRATEGIES)}, got "
                         f"{name!r}")
    return STRATEGIES[name]


def _piece(x, start, size):
    return None if x is None else jax.lax.slice_in_dim(x, start, start + size, axis=1)


def _local_length(length, offset, size):
    """A global length (B,) as the length of the piece of `size` tokens at `offset`."""
    return None if length is None else jnp.clip(length - offset, 0, size)


def _pairs(axis_name, parts, order, q_tokens, kv_tokens, step):
    """The (query piece, key piece) pairs of a ring step: ((start, size, offset) of the query
    piece, its index, (start, size, offset) of the key piece) each, for the key shard that
    this device holds at `step` (device i - step's)."""
    index = jax.lax.axis_index(axis_name)
    source = (index - step) % parts
    queries = _sharding.local_chunks(order, parts, index, q_tokens)
    keys = _sharding.local_chunks(order, parts, source, kv_tokens)
    return [(qp, a, kp) for kp in keys for a, qp in enumerate(queries)]


def _pass_on(arrays, axis_name, parts):
    """The arrays (None stays None) from device i - 1 of the sequence axis, to device i + 1."""
    perm = [(i, (i + 1) % parts) for i in range(parts)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), arrays)


def _merge(acc, out, lse):
    """Two partial softmax results of the same rows, (out f32, lse) each, as one: the
    outputs weighted by exp(lse_part - lse). Rows that see nothing in either stay (0, -inf)
    with finite gradients."""
    if acc is None:
        return out.astype(jnp.float32), lse
    acc_out, acc_lse = acc
    top = jnp.maximum(acc_lse, lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_acc, w = jnp.exp(acc_lse - top), jnp.exp(lse - top)
    total = w_acc + w
    seen = total > 0
    new_lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    scale = 1.0 / jnp.where(seen, total, 1.0)
    new_out = (acc_out * (w_acc * scale)[..., None]
               + out.astype(jnp.float32) * (w * scale)[..., None])
    return new_out, new_lse


def _ring_forward(compute, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len, kv_len):
    held = (k, v, kv_seg)
    results = {}
    for step in range(parts):
        incoming = _pass_on(held, axis_name, parts) if step + 1 < parts else None
        k_s, v_s, seg_s = held
        for (qs, qz, qo), a, (ks, kz, ko) in _pairs(axis_name, parts, order, q.shape[1],
                                                    k.shape[1], step):
            out, lse = compute(_piece(q, qs, qz), _piece(k_s, ks, kz), _piece(v_s, ks, kz),
                               _piece(q_seg, qs, qz), _piece(seg_s, ks, kz),
                               _local_length(q_len, qo, qz), _local_length(kv_len, ko, kz),
                               ko - qo)
            results[a] = _merge(results.get(a), out, lse)
        held = incoming
    out, lse = (jnp.concatenate(p, axis=1) for p in zip(*(results[a] for a in sorted(results)),
                                                         strict=True))
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ring(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len, kv_len):
    return _ring_forward(compute, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
                         kv_len)


def _ring_fwd(compute, gradients, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
              kv_len):
    out, lse = _ring_forward(compute, axis_name, parts, order, q, k, v, q_seg, kv_seg, q_len,
                             kv_len)
    return (out, lse), (q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse)


def _ring_bwd(compute, gradients, axis_name, parts, order, residuals, cotangents):
    q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse = residuals
    dout, dlse = cotangents
    delta = common.softmax_delta(out, dout) - dlse  # of the whole rows
    # A barrier keeps XLA from reusing the forward's passes (CSE), which would hold every
    # shard of K and V from the forward to the backward.
    held = jax.lax.optimization_barrier((k, v, kv_seg))
    dq = jnp.zeros(q.shape, jnp.float32)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(parts):
        incoming = _pass_on(held, axis_name, parts) if step + 1 < parts else None
        k_s, v_s, seg_s = held
        for (qs, qz, qo), _, (ks, kz, ko) in _pairs(axis_name, parts, order, q.shape[1],
                                                    k.shape[1], step):
            dq_p, dk_p, dv_p = gradients(
                _piece(q, qs, qz), _piece(k_s, ks, kz), _piece(v_s, ks, kz),
                _piece(q_seg, qs, qz), _piece(seg_s, ks, kz), _local_length(q_len, qo, qz),
                _local_length(kv_len, ko, kz), ko - qo, _piece(dout, qs, qz),
                _piece(lse, qs, qz), _piece(delta, qs, qz))
            dq = dq.at[:, qs:qs + qz].add(dq_p.astype(jnp.float32))
            dkv = (dkv[0].at[:, ks:ks + kz].add(dk_p.astype(jnp.float32)),
                   dkv[1].at[:, ks:ks + kz].add(dv_p.astype(jnp.float32)))
        dkv = _pass_on(dkv, axis_name, parts)  # with its shard, home after the n-th pass
        held = incoming
    return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None,
            None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
