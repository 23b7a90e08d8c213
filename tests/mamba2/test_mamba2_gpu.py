"""The SSD kernels compiled for a real GPU, at training sizes (run on the H200)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error
from ssd_cases import loss_and_grads, make_inputs

import pallas_kernels
from pallas_kernels.mamba2 import reference, walks

pytestmark = pytest.mark.gpu

pallas = functools.partial(pallas_kernels.mamba_chunk_scan_combined, implementation="pallas")


def _upcast(args):
    return {k: v.astype(jnp.float32) if v is not None and v.dtype == jnp.bfloat16 else v
            for k, v in args.items()}


def _against_float32_reference(args):
    """Ours (chunk_size 256, dt_softplus) against the float32 chunked reference on upcast inputs:
    asserts the bf16 bounds on y, the final state and every gradient; returns (y, y_ref)."""
    kw = dict(chunk_size=256, dt_softplus=True)
    (y, final), grads = jax.jit(functools.partial(loss_and_grads, pallas, **kw))(args)
    (y_ref, final_ref), grads_ref = jax.jit(functools.partial(
        loss_and_grads, reference.mamba_chunk_scan_combined, **kw))(_upcast(args))
    assert rel_error(y, y_ref) < 2e-2
    assert rel_error(final, final_ref) < 2e-2
    for name, grad in grads.items():
        assert rel_error(grad, grads_ref[name]) < 3e-2, name
    return y, y_ref


@pytest.mark.parametrize("groups,seq_idx", [(1, False), (8, True)])
def test_bf16_against_float32_reference(groups, seq_idx):
    args = make_inputs(1, b=2, t=4096, h=16, p=64, n=128, g=groups, d="h",
                       dtype=jnp.bfloat16, seq_idx=seq_idx)
    _against_float32_reference(args)


@pytest.mark.parametrize("batch, t, num_parts", [(4, 4096, 1), (2, 8192, 2)],
                         ids=["last-round-split", "halves-split"])
def test_cut_walks_against_float32_reference(batch, t, num_parts, monkeypatch):
    """80 heads at 16k tokens on an H200 (264 forward programs at once): at b 4 the forward
    walks 264 walks whole and splits the other 56; at b 2 it walks halves and splits the 56
    first halves beyond one round (schedule.forward_schedule). Split walks are walks 0 .. 55,
    in row 0."""
    calls = []
    unit_sums = walks.unit_sums
    monkeypatch.setattr(walks, "unit_sums", lambda *a, plan, **kw: calls.append(
        plan.schedule) or unit_sums(*a, plan=plan, **kw))
    args = make_inputs(5, b=batch, t=t, h=80, p=64, n=64, g=1, d="h", dtype=jnp.bfloat16,
                       z=False)
    y, y_ref = _against_float32_reference(args)
    assert calls and calls[0].num_parts == num_parts and calls[0].split_walks == 56
    assert rel_error(y[0], y_ref[0]) < 2e-2  # the row of the split walks


def test_131072_tokens():
    """Past mamba_ssm's int32 offset overflow (~61k tokens)."""
    args = make_inputs(2, b=1, t=131072, h=4, p=64, n=64, g=1, d="h", dtype=jnp.bfloat16,
                       z=False)
    y, y_ref = _against_float32_reference(args)
    assert rel_error(y[:, -1000:], y_ref[:, -1000:]) < 2e-2  # the tail, past 2**16 tokens


def test_extreme_decays_no_nan():
    args = make_inputs(3, b=2, t=2048, h=8, p=64, n=64, g=2, d="h", dtype=jnp.bfloat16)
    args["dt"] = jnp.full_like(args["dt"], 20.0).at[:, ::7].set(-30.0)
    args["A"] = -jnp.geomspace(1e-3, 100.0, 8)
    (y, final), grads = jax.jit(functools.partial(
        loss_and_grads, pallas, chunk_size=256, dt_softplus=True))(args)
    for value in (y, final, *grads.values()):
        assert np.all(np.isfinite(np.asarray(value, np.float32)))


@pytest.mark.parametrize("groups", [1, 8])
def test_gradients_bitwise_deterministic(groups):
    """No atomics anywhere: kernels, head-block sums and the state-term matmuls repeat exactly."""
    args = make_inputs(4, b=2, t=4096, h=80, p=64, n=128, g=groups, d="h",
                       dtype=jnp.bfloat16, seq_idx=True)
    run = jax.jit(functools.partial(loss_and_grads, pallas, chunk_size=256, dt_softplus=True))
    first, second = run(args), run(args)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



def test_inside_a_shard_map_with_check_vma_equals_the_direct_call():
    """Batch sharded over every local GPU in a user's shard_map with check_vma=True (jax's
    default): y, the final state and every gradient equal the direct call's; the replicated
    parameters' (A, D, dt_bias) gradients are summed over the shards by the backward rule."""
    devices = jax.device_count()
    args = make_inputs(0, b=2 * devices, t=512, h=8, p=64, n=64, g=1, dtype=jnp.bfloat16)
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    batch, whole = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
    specs = {k: None if v is None else whole if k in ("A", "D", "dt_bias") else batch
             for k, v in args.items()}
    kw = dict(chunk_size=256, dt_softplus=True)
    sharded = jax.shard_map(lambda a: pallas(**a, **kw, return_final_states=True), mesh=mesh,
                            in_specs=(specs,), out_specs=(batch, batch))
    (y, final), grads = jax.jit(functools.partial(
        loss_and_grads, lambda return_final_states, **a: sharded(a)))(args)
    (y_ref, final_ref), grads_ref = jax.jit(functools.partial(loss_and_grads, pallas, **kw))(args)
    assert rel_error(y, y_ref) < 1e-6 and rel_error(final, final_ref) < 1e-6
    for name, grad in grads.items():  # bf16 sums in another order; a lost or doubled sum is not
        assert rel_error(grad, grads_ref[name]) < 1e-3, name


def test_decode_step_against_the_ops_references_on_the_gpu():
    """The mixer's decode step (`mixer.split_conv_step`) at the zamba2-like shape, batch 64:
    the conv update and the state update reading in_proj's output in place, against the two
    public ops' references in float32."""
    from pallas_kernels.mamba2 import mixer

    shape = mixer.MixerShape(d_ssm=4096, ngroups=1, d_state=64, nheads=64, norm_group_size=4096)
    keys = jax.random.split(jax.random.key(7), 8)
    b, d, gn = 64, shape.d_ssm, shape.d_state
    zxbcdt = jax.random.normal(keys[0], (b, shape.width), jnp.bfloat16)
    conv_state = jax.random.normal(keys[1], (b, 3, shape.conv_dim), jnp.bfloat16)
    ssm_state = jax.random.normal(keys[2], (b, 64, 64, 64), jnp.bfloat16)
    weight = jax.random.normal(keys[3], (4, shape.conv_dim)) * 0.5
    bias = jax.random.normal(keys[4], (shape.conv_dim,)) * 0.5
    dt_bias = jax.random.uniform(keys[5], (64,), minval=-3.0, maxval=-1.0)
    A = -jax.random.uniform(keys[6], (64,), minval=0.5, maxval=4.0)
    D = jax.random.normal(keys[7], (64,))
    y, new_conv, new_ssm = jax.jit(functools.partial(
        mixer.split_conv_step, shape=shape, column_offset=0, dt_limit=(0.0, float("inf")),
        interpret=False))(zxbcdt, conv_state, ssm_state, weight, bias, dt_bias, jnp.log(-A), D)
    xbc, want_conv = pallas_kernels.causal_conv1d_update(
        zxbcdt[:, d:d + shape.conv_dim].astype(jnp.float32), conv_state, weight, bias,
        implementation="xla")
    want_y, want_ssm = pallas_kernels.selective_state_update(
        ssm_state, xbc[:, :d].reshape(b, 64, 64), zxbcdt[:, d + shape.conv_dim:], A,
        xbc[:, d:d + gn].reshape(b, 1, gn), xbc[:, d + gn:].reshape(b, 1, gn), D=D,
        dt_bias=dt_bias, dt_softplus=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32),
                                  np.asarray(want_conv, np.float32))
    assert rel_error(y, want_y) < 2e-2
    assert rel_error(new_ssm, want_ssm) < 1e-2
