"""Both ops on 8 (simulated) devices: batch and head sharding, found from the arrays' types on
`jax.make_mesh` meshes (Explicit axes) and from `sharding=` on classic meshes, against the
unsharded call; no all-gather of a kernel input; a sharding that cannot be honoured raises a
ValueError naming the argument and the mesh axis.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (`.ci/run` does).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_inputs as attention_inputs
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_cases import mesh, seed
from numerics import rel_error
from ssd_cases import DIFFERENTIABLE
from ssd_cases import make_inputs as ssd_inputs

import pallas_kernels
from pallas_kernels import _compat, _sharding

pytestmark = pytest.mark.multidevice

MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "tensor"))}
# (id, mesh, PartitionSpec of the leading array): batch, heads, batch x heads.
SHARDINGS = [
    ("batch-8", "8", P("data")),
    ("heads-8", "8", P(None, None, "data")),
    ("batch2-heads4", "2x4", P("data", None, "tensor")),
]
HEADS_AXIS_SIZE = {"batch-8": 1, "heads-8": 8, "batch2-heads4": 4}


def _combinations(cases):
    """Every case on make_mesh meshes; the first also on classic meshes (`sharding=`)."""
    return [pytest.param(case, sharding, explicit,
                         id=f"{case[0]}-{sharding[0]}-{'make_mesh' if explicit else 'classic'}")
            for i, case in enumerate(cases) for sharding in SHARDINGS
            for explicit in ((True, False) if i == 0 else (True,))]


def _mesh(name, explicit):
    return mesh(*MESHES[name], explicit)


def _sharded(fn, mesh, spec, explicit, lead, rest):
    """fn(lead, *rest) with `lead` placed by `spec`: on an explicit mesh through its type, on a
    classic one through `sharding=`, under jit; and the gradient of the sum of squares of
    every output."""
    sharding = NamedSharding(mesh, spec)
    lead = jax.device_put(lead, sharding)
    kw = {} if explicit else dict(sharding=sharding)

    def loss(lead, rest):
        outs = fn(lead, *rest, **kw)
        return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(outs))

    if explicit:
        with jax.set_mesh(mesh):
            return (jax.jit(functools.partial(fn, **kw))(lead, *rest),
                    jax.jit(jax.grad(loss, argnums=(0, 1)))(lead, rest))
    return (jax.jit(functools.partial(fn, **kw))(lead, *rest),
            jax.jit(jax.grad(loss, argnums=(0, 1)))(lead, rest))


def _unsharded(fn, lead, rest):
    def loss(lead, rest):
        outs = fn(lead, *rest)
        return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(outs))

    return jax.jit(fn)(lead, *rest), jax.jit(jax.grad(loss, argnums=(0, 1)))(lead, rest)


def _assert_same(got, want, tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        assert rel_error(a, b) < tol


ATTENTION = [
    ("gqa-causal", dict(is_causal=True), ()),
    ("window-softcap", dict(local_window_size=(5, 2), logits_soft_cap=3.0), ()),
    ("segments-lengths", {}, ("segments", "lengths")),
    ("user-mask-bias", dict(  # a mask the kernels read 8 keys a byte, split as the rows
        mask=jnp.asarray((np.random.default_rng(7).random((8, 8, 32, 32)) < 0.7) | np.eye(32,
                                                                                    dtype=bool)),
        bias=jnp.asarray(np.random.default_rng(8).standard_normal((1, 8, 32, 32)), jnp.float32)),
     ()),
]


@pytest.mark.parametrize("case, sharding, explicit", _combinations(ATTENTION))
def test_attention_matches_unsharded(case, sharding, explicit):
    name, kw, mask = case
    _, mesh_name, spec = sharding
    k_heads = max(4, HEADS_AXIS_SIZE[sharding[0]])  # GQA 2:1 where the heads axis allows
    args, masks = attention_inputs(seed(name, sharding[0]), b=8, t=32, n=8, k=k_heads,
                                   h=16, mask=mask)
    q, k, v = args[:3]

    def attention(q, k, v, **extra):
        return pallas_kernels.dot_product_attention(
            q, k, v, implementation="pallas", **kw, **masks, **extra)

    got = _sharded(attention, _mesh(mesh_name, explicit), spec, explicit, q, (k, v))
    _assert_same(got, _unsharded(attention, q, (k, v)), 2e-5)


SSD = [
    ("d-z-bias-h0-g1", dict(g=1), {}),
    ("groups-seq-idx", dict(g=2, seq_idx=True), {}),
    ("limits", dict(g=1, d="hp"), dict(dt_limit=(0.05, 2.0))),
]


@pytest.mark.parametrize("case, sharding, explicit", _combinations(SSD))
def test_ssd_matches_unsharded(case, sharding, explicit):
    name, shape, kw = case
    _, mesh_name, spec = sharding
    if shape["g"] > 1:  # the groups shard with the heads: as many as the heads axis has devices
        shape = dict(shape, g=max(shape["g"], HEADS_AXIS_SIZE[sharding[0]]))
    inputs = ssd_inputs(seed(name, sharding[0]), b=8, t=32, h=8, p=8, n=16, **shape)
    seq_idx = inputs.pop("seq_idx", None)
    rest_names = [n for n in DIFFERENTIABLE if n != "x" and inputs.get(n) is not None]

    def ssd(x, *rest, **extra):
        return pallas_kernels.mamba_chunk_scan_combined(
            x, **dict(zip(rest_names, rest, strict=True)), chunk_size=16, seq_idx=seq_idx,
            dt_softplus=True, return_final_states=True, implementation="pallas", **kw, **extra)

    rest = tuple(inputs[n] for n in rest_names)
    got = _sharded(ssd, _mesh(mesh_name, explicit), spec, explicit, inputs["x"], rest)
    _assert_same(got, _unsharded(ssd, inputs["x"], rest), 2e-5)


# Token-wise ops: batch or sequence sharding (the norm), batch only (the conv).
TOKEN_SHARDINGS = [("batch-8", "8", P("data")), ("sequence-8", "8", P(None, "data"))]


@pytest.mark.parametrize("explicit", [True, False], ids=["make_mesh", "classic"])
@pytest.mark.parametrize("sharding", TOKEN_SHARDINGS, ids=[s[0] for s in TOKEN_SHARDINGS])
def test_gated_norm_matches_unsharded(sharding, explicit):
    """Per shard, and the weight's gradient summed over the shards."""
    keys = jax.random.split(jax.random.key(seed("norm", sharding[0])), 3)
    x, z = (jax.random.normal(k, (8, 32, 64)) for k in keys[:2])
    weight = 1.0 + 0.1 * jax.random.normal(keys[2], (64,))

    def norm(x, weight, z, **extra):
        return pallas_kernels.rms_norm_gated(x, weight, z, norm_before_gate=False,
                                             implementation="pallas", **extra)

    got = _sharded(norm, _mesh(sharding[1], explicit), sharding[2], explicit, x, (weight, z))
    _assert_same(got, _unsharded(norm, x, (weight, z)), 2e-5)


@pytest.mark.parametrize("explicit", [True, False], ids=["make_mesh", "classic"])
def test_causal_conv_matches_unsharded_over_the_batch(explicit):
    keys = jax.random.split(jax.random.key(seed("conv")), 4)
    x = jax.random.normal(keys[0], (8, 40, 64))
    weight, bias = jax.random.normal(keys[1], (4, 64)), jax.random.normal(keys[2], (64,))
    states = jax.random.normal(keys[3], (8, 3, 64))

    def conv(x, weight, bias, states, **extra):
        return pallas_kernels.causal_conv1d(x, weight, bias, initial_states=states,
                                            implementation="pallas", **extra)

    got = _sharded(conv, _mesh("8", explicit), P("data"), explicit, x, (weight, bias, states))
    _assert_same(got, _unsharded(conv, x, (weight, bias, states)), 2e-5)


def test_causal_conv_refuses_a_sharded_sequence():
    x = jnp.zeros((2, 64, 16))
    with pytest.raises(ValueError, match="x: its sequence is sharded over mesh axis 'data'"):
        pallas_kernels.causal_conv1d(x, jnp.ones((4, 16)), implementation="pallas",
                                     sharding=NamedSharding(_mesh("8", False), P(None, "data")))


def test_no_kernel_input_is_gathered():
    mesh = _mesh("2x4", explicit=False)
    sharding = NamedSharding(mesh, P("data", None, "tensor"))
    q = jax.ShapeDtypeStruct((8, 64, 8, 16), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((8, 64, 4, 16), jnp.float32, sharding=sharding)

    def step(q, k, v):
        out, vjp = jax.vjp(functools.partial(
            pallas_kernels.dot_product_attention, is_causal=True, implementation="pallas",
            sharding=sharding), q, k, v)
        return vjp(out)

    text = jax.jit(step).lower(q, kv, kv).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text

    x = jax.ShapeDtypeStruct((8, 64, 8, 16), jnp.float32, sharding=sharding)
    rows = NamedSharding(mesh, P("data"))
    bc = jax.ShapeDtypeStruct((8, 64, 1, 16), jnp.float32, sharding=rows)
    dt = jax.ShapeDtypeStruct((8, 64, 8), jnp.float32, sharding=NamedSharding(
        mesh, P("data", None, "tensor")))
    heads = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("tensor")))

    def ssd_step(x, dt, A, B, C):
        return jax.grad(lambda *a: jnp.sum(pallas_kernels.mamba_chunk_scan_combined(
            *a, chunk_size=16, implementation="pallas", sharding=sharding)),
            argnums=(0, 1, 2, 3, 4))(x, dt, A, B, C)

    text = jax.jit(ssd_step).lower(x, dt, heads, bc, bc).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text


@pytest.mark.parametrize("platform, device_kind", [("cuda", "NVIDIA H200"), ("rocm", "gfx942")])
def test_every_triton_call_gets_local_shapes_on_8_gpus(platform, device_kind):
    """Lowered ahead of time for 8 abstract GPUs (4 x 2: batch over data, heads over tensor):
    every Triton call of attention's and the SSD's train step sees a shard's shapes."""
    mesh = _compat.abstract_gpu_mesh(device_kind, platform, (4, 2), ("data", "tensor"),
                                     axis_types=(AxisType.Explicit,) * 2)
    sharded = NamedSharding(mesh, P("data", None, "tensor"))
    q = jax.ShapeDtypeStruct((8, 1024, 16, 128), jnp.bfloat16, sharding=sharded)
    x = jax.ShapeDtypeStruct((8, 1024, 16, 64), jnp.bfloat16, sharding=sharded)
    dt = jax.ShapeDtypeStruct((8, 1024, 16), jnp.bfloat16, sharding=NamedSharding(
        mesh, P("data", None, "tensor")))
    A = jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P("tensor")))
    bc = jax.ShapeDtypeStruct((8, 1024, 1, 128), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P("data")))

    def attention_step(q, k, v):
        out, vjp = jax.vjp(functools.partial(pallas_kernels.dot_product_attention,
                                             is_causal=True), q, k, v)
        return vjp(out)

    def ssd_step(x, dt, A, B, C):
        return jax.grad(lambda *a: jnp.sum(pallas_kernels.mamba_chunk_scan_combined(
            *a, chunk_size=256, dt_softplus=True).astype(jnp.float32)),
            argnums=(0, 1, 2, 3, 4))(x, dt, A, B, C)

    with jax.sharding.use_abstract_mesh(mesh):
        texts = [jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
                 for step, args in ((attention_step, (q, q, q)), (ssd_step, (x, dt, A, bc, bc)))]
    for text in texts:
        calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
        assert calls
        for call in calls:  # token arrays: 2 of 8 rows; (B, T, heads, dim) ones: 8 of 16 heads
            assert set(re.findall(r"tensor<(\d+)x1024x", call)) <= {"2"}, call[-300:]
            assert not re.search(r"tensor<\d+x1024x16x\d+x", call), call[-300:]


def _attention_call(q, k, spec, mesh):
    return pallas_kernels.dot_product_attention(
        q, k, k, implementation="xla", sharding=NamedSharding(mesh, spec))


@pytest.mark.parametrize("spec, k_heads, needle", [
    (P(None, None, None, "data"), 8, "query's head dim is sharded over mesh axis 'data'"),
    (P(None, None, "data"), 4, r"key: the key/value heads \(4\) does not divide over mesh axis "
                               "'data' of size 8"),
])
def test_attention_sharding_errors(spec, k_heads, needle):
    mesh = _mesh("8", explicit=False)
    q = jnp.zeros((8, 16, 8, 16))
    with pytest.raises(ValueError, match=needle):
        _attention_call(q, jnp.zeros((8, 16, k_heads, 16)), spec, mesh)


def test_ssd_groups_must_divide_over_the_heads_axis():
    mesh = _mesh("2x4", explicit=False)
    inputs = ssd_inputs(1, b=2, t=16, h=8, p=8, n=16, g=2)
    inputs.pop("seq_idx", None)
    with pytest.raises(ValueError, match=r"B: the groups \(2\) does not divide over mesh axis "
                                         "'tensor' of size 4"):
        pallas_kernels.mamba_chunk_scan_combined(
            **inputs, chunk_size=16, implementation="xla",
            sharding=NamedSharding(mesh, P(None, None, "tensor")))


def test_partition_spec_needs_a_mesh_and_sharding_a_known_type():
    q = jnp.zeros((8, 16, 8, 16))
    with pytest.raises(ValueError, match="a PartitionSpec needs a mesh"):
        pallas_kernels.dot_product_attention(q, q, q, sharding=P("data"))
    with pytest.raises(TypeError, match="sharding must be a jax.sharding.NamedSharding"):
        pallas_kernels.dot_product_attention(q, q, q, sharding="data")
    mesh = _mesh("8", explicit=False)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q: pallas_kernels.dot_product_attention(
            q, q, q, implementation="xla", sharding=P("data")))(q)
        with pytest.raises(ValueError, match=r"mesh axes \['nope'\] are not in the mesh"):
            pallas_kernels.dot_product_attention(q, q, q, sharding=P("nope"))
    assert out.shape == q.shape


def test_inside_a_shard_map_the_ops_run_on_the_local_shards():
    mesh = _mesh("8", explicit=False)
    q = jax.random.normal(jax.random.key(0), (8, 16, 4, 16))

    def local(q):
        assert q.shape[0] == 1
        return pallas_kernels.dot_product_attention(q, q, q, implementation="pallas")

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                check_vma=False))(q)
    want = pallas_kernels.dot_product_attention(q, q, q, implementation="pallas")
    assert rel_error(out, want) < 1e-6


@pytest.mark.parametrize("platform, device_kind", [("cuda", "NVIDIA H200"), ("rocm", "gfx942")])
def test_inside_a_shard_map_with_check_vma_the_kernels_lower_and_reduce_replicated_gradients(
        platform, device_kind):
    """A user's shard_map with check_vma=True (jax's default) over 8 abstract GPUs: the
    kernels' outputs and gradients carry the types check_vma asks for, and the gradient of a
    parameter replicated over the batch axis (the SSD's A) is summed over it once, inside the
    backward rule."""
    mesh = _compat.abstract_gpu_mesh(device_kind, platform, (4, 2), ("data", "tensor"),
                                     axis_types=(AxisType.Explicit,) * 2)
    tokens = P("data", None, "tensor")

    def struct(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def attention_step(q, k, v):
        out, vjp = jax.vjp(functools.partial(pallas_kernels.dot_product_attention,
                                             is_causal=True), q, k, v)
        return vjp(out)

    def ssd_step(x, dt, A, B, C):
        def loss(x, dt, A):
            y = pallas_kernels.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=256,
                                                         dt_softplus=True)
            return jnp.sum(y.astype(jnp.float32))

        dx, ddt, dA = jax.grad(loss, argnums=(0, 1, 2))(x, dt, A)
        assert not _sharding.varying_axes(dA) & {"data"}  # reduced over the batch shards
        return dx, ddt, dA

    steps = [
        (attention_step, (struct((8, 1024, 16, 128), tokens),) * 3, (tokens,) * 3,
         (tokens,) * 3),
        (ssd_step, (struct((8, 1024, 16, 64), tokens), struct((8, 1024, 16), tokens),
                    struct((16,), P("tensor"), jnp.float32), struct((8, 1024, 1, 128), P("data")),
                    struct((8, 1024, 1, 128), P("data"))),
         (tokens, tokens, P("tensor"), P("data"), P("data")), (tokens, tokens, P("tensor"))),
    ]
    with jax.sharding.use_abstract_mesh(mesh):
        for step, args, in_specs, out_specs in steps:
            mapped = jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            text = jax.jit(mapped).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert "__gpu$xla.gpu.triton" in text
    reduces = [line for line in text.splitlines() if "all_reduce" in line]  # the SSD's
    assert len(reduces) == 1 and 'name = "data"' in reduces[0], reduces  # dA, over "data"


def test_a_custom_vjp_cotangent_takes_its_primal_type_under_check_vma():
    """`_sharding.cotangent_like`, as the kernels' backward rules use it, against jax's own
    transpose of the same function: a weight replicated over the shards gets the sum of their
    gradients, a sharded input its own."""
    mesh = _mesh("8", explicit=False)

    @jax.custom_vjp
    def scale(w, x):
        return x * w

    def scale_fwd(w, x):
        return scale(w, x), (w, x)

    def scale_bwd(residuals, dy):
        w, x = residuals
        dw, dx = jnp.sum(dy * x, axis=0), dy * w  # dw varies over "data"; w does not
        return _sharding.cotangent_like(dw, w), _sharding.cotangent_like(dx, x)

    scale.defvjp(scale_fwd, scale_bwd)
    w = jax.random.normal(jax.random.key(1), (4,))
    x = jax.random.normal(jax.random.key(2), (16, 4))

    def gradients(fn):
        loss = jax.shard_map(lambda w, x: jax.lax.psum(jnp.sum(fn(w, x) ** 2), "data"),
                             mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)

    got, want = gradients(scale), gradients(lambda w, x: x * w)
    for g, r in zip(got, want, strict=True):
        assert rel_error(g, r) < 1e-6


def test_interpret_mode_inside_a_shard_map_with_check_vma_says_what_to_do():
    mesh = _mesh("8", explicit=False)
    q = jnp.zeros((8, 16, 4, 16))

    def local(q):
        return pallas_kernels.dot_product_attention(q, q, q, implementation="pallas")

    with pytest.raises(NotImplementedError, match="check_vma=False"):
        jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(q)
