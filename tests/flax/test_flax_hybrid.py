"""HybridLM: decode == forward, kernels vs reference, training, generation (ragged prompts,
8-bit KV caches, sampling, stop tokens, no cache copies in the loop), Linen wrappers,
configuration, cache and argument checks."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_layers import HybridLM, HybridLMConfig, generation
from flax_layers import linen as linen_layers

SMALL = dict(d_model=32, num_layers=2, shared_every=2, num_heads=2, num_kv_heads=1,
             attn_head_dim=16, mlp_hidden=64, d_state=16, ssm_head_dim=16, chunk_size=16)


def _close(x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _small_model():
    return HybridLM(HybridLMConfig(**SMALL, implementation="xla"), rngs=nnx.Rngs(0))


def _caches(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Cache))]


def _assert_same(caches, model):
    for before, after in zip(caches, _caches(model), strict=True):
        assert np.array_equal(before, after)


@nnx.jit
def _decode(model, tokens, lengths=None):
    """A decode call, compiled (once per shape: eagerly every op would compile)."""
    return model(tokens, decode=True, lengths=lengths)


def test_prefill_then_decode_equals_forward_with_a_forward_between():
    model = HybridLM(HybridLMConfig.preset("tiny", implementation="xla"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 14), 0, 256)
    full = model(tokens)
    model.init_cache(2, 16)
    prefill = _decode(model, tokens[:, :6])
    caches = _caches(model)
    model(255 - tokens)  # a plain forward between decode calls touches no cache
    _assert_same(caches, model)
    steps = [_decode(model, tokens[:, t:t + 1]) for t in range(6, 14)]
    _close(jnp.concatenate([prefill, *steps], axis=1), full, 1e-4)


def test_pallas_and_xla_agree_with_gradients():
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, 256)
    segments = jnp.array([[0] * 8 + [1] * 12, [0] * 20], jnp.int32)

    def loss(model):
        logits = model(tokens, segment_ids=segments)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), logits

    outs, grads = [], []
    for implementation in ("pallas", "xla"):
        model = HybridLM(HybridLMConfig(**SMALL, implementation=implementation),
                         rngs=nnx.Rngs(0))
        (_, logits), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)  # eager: slow
        outs.append(logits)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.Param)))
    _close(*outs, 1e-4)
    for a, b in zip(*grads, strict=True):
        _close(a, b, 1e-4)


def test_jit_train_step_lowers_the_loss():
    model = HybridLM(HybridLMConfig.preset("tiny", implementation="xla"), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 32)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, tokens)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_generate_is_deterministic_at_temperature_zero():
    model = HybridLM(HybridLMConfig(**SMALL, implementation="xla"), rngs=nnx.Rngs(0))
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    first = model.generate(prompt, 4, temperature=0.0, rng=jax.random.key(0))
    second = model.generate(prompt, 4, temperature=0.0, rng=jax.random.key(9))
    assert first.shape == (2, 4) and first.dtype == jnp.int32
    assert np.array_equal(first, second)


def test_linen_wrappers_init_and_apply():
    x = jnp.ones((2, 8, 16))
    attention = linen_layers.FlashMultiHeadAttention(2, 16, num_kv_heads=1, is_causal=True,
                                                     implementation="xla")
    variables = attention.init(jax.random.key(0), x)
    assert attention.apply(variables, x).shape == (2, 8, 16)
    mixer = linen_layers.Mamba2(16, d_state=16, headdim=8, chunk_size=16, implementation="xla")
    variables = mixer.init(jax.random.key(0), x)
    assert mixer.apply(variables, x).shape == (2, 8, 16)
    lm = linen_layers.HybridLM(HybridLMConfig(**SMALL, implementation="xla"))
    tokens = jnp.ones((2, 8), jnp.int32)
    variables = lm.init(jax.random.key(0), tokens)
    assert lm.apply(variables, tokens).shape == (2, 8, 256)


def test_decode_past_the_caches_is_a_value_error_before_any_cache_changes():
    model = _small_model()
    tokens = jnp.ones((2, 17), jnp.int32)
    model.init_cache(2, 16)
    caches = _caches(model)
    with pytest.raises(ValueError, match="KV cache holds 16 positions; 17 new tokens do not fit"):
        model(tokens, decode=True)  # a prompt longer than the caches
    with pytest.raises(ValueError, match="batch 3 does not match the Mamba2 cache's batch 2"):
        model(jnp.ones((3, 1), jnp.int32), decode=True)
    _assert_same(caches, model)
    model(tokens[:, :15], decode=True)
    caches = _caches(model)
    with pytest.raises(ValueError, match="16 positions; 15 are filled and 2 new tokens do not"):
        model(tokens[:, :2], decode=True)
    _assert_same(caches, model)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens[:, :1], segment_ids=jnp.zeros((2, 1), jnp.int32), decode=True)


def test_decode_past_the_caches_under_jit_gives_nan_logits_and_keeps_the_kv_caches():
    model = _small_model()
    step = nnx.jit(lambda model, tokens: model(tokens, decode=True))
    tokens = jnp.ones((2, 5), jnp.int32)
    model.init_cache(2, 16)  # a dense cache's capacity is a multiple of 16
    for _ in range(3):  # 15 of the 16 positions filled
        assert np.isfinite(step(model, tokens)).all()
    keys = [np.asarray(slot.keys[...]) for slot in model.kv_caches]
    assert np.isnan(step(model, tokens)).all()
    for k, slot in zip(keys, model.kv_caches, strict=True):
        assert np.array_equal(k, slot.keys[...])
    assert np.isnan(step(model, tokens[:, :1])).all()  # it would fit, but the lengths moved on


def test_token_ids_outside_the_vocabulary():
    model = _small_model()
    tokens = np.ones((2, 6), np.int32)
    tokens[0, 2], tokens[1, 4] = 300, -1
    for bad in (300, -1):
        with pytest.raises(ValueError, match=rf"tokens must lie in \[0, 256\).*got {bad}"):
            model(jnp.where(tokens == bad, bad, 1))
    logits = nnx.jit(lambda model, tokens: model(tokens))(model, jnp.asarray(tokens))
    assert np.array_equal(np.isnan(logits).any(-1), (tokens < 0) | (tokens >= 256))
    assert np.isnan(logits[0, 2]).all() and np.isnan(logits[1, 4]).all()


def test_generate_takes_zero_new_tokens_without_touching_the_model():
    model = _small_model()
    out = model.generate(jnp.ones((2, 3), jnp.int32), 0, rng=jax.random.key(0))
    assert out.shape == (2, 0) and out.dtype == jnp.int32
    assert model.kv_caches is None


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(prompt_tokens=jnp.ones((3,), jnp.int32)), ValueError, "prompt_tokens must be a"),
    (dict(prompt_tokens=jnp.ones((2, 0), jnp.int32)), ValueError, "at least one token"),
    (dict(prompt_tokens=jnp.ones((0, 3), jnp.int32)), ValueError, "at least one token"),
    (dict(prompt_tokens=jnp.ones((2, 3))), TypeError, "prompt_tokens must be an integer"),
    (dict(prompt_tokens=[[1, 2]]), TypeError, "prompt_tokens must be an integer array"),
    (dict(prompt_tokens=jnp.full((2, 3), 256)), ValueError, r"prompt_tokens must lie in"),
    (dict(prompt_tokens=jnp.full((2, 3), -1)), ValueError, r"prompt_tokens must lie in"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0, got -1"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
    (dict(prefill_tokens=0), ValueError, "prefill_tokens must be a positive int, got 0"),
    (dict(prefill_tokens=8192.0), TypeError, "prefill_tokens must be an int"),
    (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=True), TypeError, "temperature must be a number"),
    (dict(rng=0), TypeError, "rng must be a PRNG key"),
    (dict(rng=jax.random.split(jax.random.key(0))), TypeError, "rng must be a PRNG key"),
    (dict(top_k=0), ValueError, "top_k must be None or an int >= 1"),
    (dict(top_p=1.5), ValueError, r"top_p must be None or a number in \(0, 1\]"),
    (dict(stop_tokens=[3, 256]), ValueError, r"stop_tokens must lie in \[0, 256\), got 256"),
    (dict(prompt_lengths=jnp.array([3, 0])), ValueError, r"prompt_lengths must lie in \[1, 3\]"),
    (dict(prompt_lengths=jnp.array([3])), ValueError, r"prompt_lengths must have shape \(2,\)"),
    (dict(prompt_lengths=jnp.array([3.0, 1.0])), TypeError, "prompt_lengths must be an integer"),
    (dict(ssm_dtype="int8"), TypeError, "ssm_dtype must be float32, bfloat16"),
])
def test_generate_checks_its_arguments(kwargs, error, needle):
    model = _small_model()
    arguments = dict(prompt_tokens=jnp.ones((2, 3), jnp.int32), max_new_tokens=2,
                     temperature=1.0, rng=jax.random.key(0)) | kwargs
    with pytest.raises(error, match=needle):
        model.generate(arguments.pop("prompt_tokens"), arguments.pop("max_new_tokens"),
                       **arguments)
    assert model.kv_caches is None


SIZES = ("vocab_size", "d_model", "num_layers", "shared_every", "num_heads", "num_kv_heads",
         "attn_head_dim", "mlp_hidden", "d_state", "ssm_head_dim", "ngroups", "expand", "d_conv",
         "chunk_size")


@pytest.mark.parametrize("override, error, needle", [
    *[({name: 0}, ValueError, f"{name} must be a positive int, got 0") for name in SIZES],
    *[({name: -2}, ValueError, f"{name} must be a positive int, got -2") for name in SIZES[:3]],
    ({"num_layers": True}, TypeError, "num_layers must be an int, got True"),
    ({"d_model": 32.0}, TypeError, "d_model must be an int, got 32.0"),
    ({"num_layers": 3}, ValueError, r"num_layers \(3\) must be a multiple of shared_every \(2\)"),
    ({"num_kv_heads": 3}, ValueError, r"num_heads \(2\) must be divisible by num_kv_heads \(3\)"),
    ({"ssm_head_dim": 48}, ValueError,
     r"expand \* d_model \(64\) must be divisible by headdim \(48\)"),
    ({"ngroups": 3}, ValueError, r"heads \(4\) must be divisible by ngroups \(3\)"),
    ({"chunk_size": 24}, ValueError, "chunk_size must be a positive power of two, got 24"),
    ({"attn_head_dim": 15}, ValueError, "rotary embeddings .* need an even head dim, got 15"),
    ({"rope_theta": 0.0}, ValueError, "rope_theta must be a finite number > 0 or None"),
    ({"rope_theta": float("nan")}, ValueError, "rope_theta must be a finite number > 0"),
    ({"rope_theta": -1e4}, ValueError, "rope_theta must be a finite number > 0"),
    ({"dtype": jnp.int32}, TypeError, "dtype must be a floating dtype or None"),
    ({"dtype": "fp8"}, TypeError, "dtype must be a floating dtype or None"),
    ({"implementation": "cuda"}, ValueError, "implementation must be one of"),
    ({"implementation": "cudnn"}, ValueError, r"implementation must be one of \('pallas'"),
    ({"attention_implementation": "flash"}, ValueError,
     r"attention_implementation must be one of \('pallas', 'xla', 'cudnn'\)"),
    ({"remat": 1}, TypeError, "remat must be a bool"),
])
def test_bad_configuration(override, error, needle):
    with pytest.raises(error, match=needle):
        HybridLMConfig(**{**SMALL, **override})


def test_configuration_is_checked_on_replace_and_accepts_dtypes():
    config = HybridLMConfig(**{**SMALL, "attn_head_dim": 15}, rope_theta=None, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="rotary"):
        dataclasses.replace(config, rope_theta=1e4)
    with pytest.raises(TypeError, match="config must be a HybridLMConfig"):
        HybridLM(dict(SMALL), rngs=nnx.Rngs(0))


def test_presets_are_valid():
    for name in ("tiny", "small", "zamba2-1.2b"):
        HybridLMConfig.preset(name)
    zamba = HybridLMConfig.preset("zamba2-1.2b")
    assert zamba.num_layers == 36 and zamba.num_layers % zamba.shared_every == 0
    with pytest.raises(ValueError, match=r"num_layers \(38\) must be a multiple of shared_every"):
        HybridLMConfig.preset("zamba2-1.2b", num_layers=38)
    with pytest.raises(ValueError, match="preset"):
        HybridLMConfig.preset("huge")


def test_decode_needs_a_cache():
    model = _small_model()
    with pytest.raises(ValueError, match="init_cache"):
        model(jnp.ones((1, 1), jnp.int32), decode=True)


def test_every_parameter_has_logical_axis_names():
    model = HybridLM(HybridLMConfig(**SMALL, implementation="xla"), rngs=nnx.Rngs(0))
    assert model.shared.attention.query.bias is None  # Zamba2's: no biases (nnx's default has)
    attention_with_bias = linen_layers.attention.FlashMultiHeadAttention(
        2, 16, rngs=nnx.Rngs(0))
    for module in (model, attention_with_bias):
        params = nnx.state(module, nnx.Param)
        specs = nnx.get_partition_spec(params)
        for param, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True):
            assert len(spec) == param.ndim and all(name for name in spec), spec


def _greedy(model, prompt, new, **kw):
    return np.asarray(model.generate(prompt, new, temperature=0.0, rng=jax.random.key(0), **kw))


def test_generate_with_the_kernels_equals_generate_with_the_references():
    """Greedy, so any difference in the logits that changes a token shows: the prefill through
    the flash and chunked SSD kernels, the steps through the KV-cache attention kernel and
    selective_state_update (interpret mode here), against the jnp references."""
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, 256)
    tokens = [_greedy(HybridLM(HybridLMConfig(**SMALL, implementation=impl), rngs=nnx.Rngs(0)),
                      prompt, 4, prompt_lengths=jnp.array([5, 3]), page_size=16)
              for impl in ("pallas", "xla")]
    np.testing.assert_array_equal(*tokens)


def test_ragged_prompts_generate_what_each_row_generates_alone():
    model = _small_model()
    prompt = jax.random.randint(jax.random.key(4), (3, 7), 0, 256)
    lengths = [7, 2, 5]
    together = _greedy(model, prompt, 5, prompt_lengths=jnp.array(lengths))
    for row, length in enumerate(lengths):
        alone = _greedy(model, prompt[row:row + 1, :length], 5)
        np.testing.assert_array_equal(together[row], alone[0])


def test_a_prefill_in_groups_of_rows_generates_what_one_prefill_does():
    """Long prompts prefill a few rows at a time (`prefill_tokens`), and the groups' caches
    (paged, 8-bit with scales; conv and bf16 SSM states) join as one prefill's would."""
    model = _small_model()
    prompt = jax.random.randint(jax.random.key(6), (4, 7), 0, 256)
    options = dict(prompt_lengths=jnp.array([7, 2, 5, 6]), kv_dtype="int8", page_size=16,
                   ssm_dtype="bfloat16")
    whole = _greedy(model, prompt, 5, **options)
    assert generation._prefill_rows(4, 7, 14) == 2 and generation._prefill_rows(4, 7, 6) == 1
    for tokens in (14, 1):  # groups of 2 rows, of 1
        np.testing.assert_array_equal(
            _greedy(model, prompt, 5, prefill_tokens=tokens, **options), whole)


def test_decode_after_a_ragged_prefill_equals_the_forward():
    """Rows padded at the end: each row's logits, and the step after it, are the forward's."""
    model = _small_model()
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, 256)
    full = model(tokens)
    model.init_cache(2, 16, page_size=16)
    lengths = jnp.array([8, 5])
    prefill = _decode(model, tokens[:, :8], lengths=lengths)
    _close(prefill[0, :8], full[0, :8], 1e-4)
    _close(prefill[1, :5], full[1, :5], 1e-4)
    step = _decode(model, jnp.stack([tokens[0, 8], tokens[1, 5]])[:, None])
    _close(step[0, 0], full[0, 8], 1e-4)
    _close(step[1, 0], full[1, 5], 1e-4)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_8_bit_kv_caches_decode_close_to_float(kv_dtype):
    """The logits of decode steps over an 8-bit paged KV cache against a float32 one: within
    the quantisation error (int8: about 1%; e4m3: about 6%)."""
    model = _small_model()
    tokens = jax.random.randint(jax.random.key(6), (2, 12), 0, 256)
    logits = []
    for dtype in (jnp.float32, kv_dtype):
        model.init_cache(2, 16, kv_dtype=dtype, page_size=16)
        _decode(model, tokens[:, :6])
        logits.append(jnp.concatenate([_decode(model, tokens[:, t:t + 1])
                                       for t in range(6, 12)], axis=1))
    error = float(jnp.max(jnp.abs(logits[1] - logits[0])) / jnp.max(jnp.abs(logits[0])))
    assert 0 < error < (2e-2 if kv_dtype == jnp.int8 else 1e-1)


def test_bfloat16_ssm_states_decode_close_to_float():
    """The logits of decode steps with bf16 SSM states (rounded after every token) against
    float32 ones: within bf16's rounding."""
    model = _small_model()
    tokens = jax.random.randint(jax.random.key(8), (2, 12), 0, 256)
    logits = []
    for ssm_dtype in (jnp.float32, jnp.bfloat16):
        model.init_cache(2, 16, ssm_dtype=ssm_dtype)
        _decode(model, tokens[:, :6])
        logits.append(jnp.concatenate([_decode(model, tokens[:, t:t + 1])
                                       for t in range(6, 12)], axis=1))
    assert {block.mixer.ssm_state[...].dtype for block in model.blocks} == {jnp.dtype("bfloat16")}
    error = float(jnp.max(jnp.abs(logits[1] - logits[0])) / jnp.max(jnp.abs(logits[0])))
    assert 0 < error < 1e-2


def test_a_row_that_samples_a_stop_token_repeats_it():
    model = _small_model()
    prompt = jax.random.randint(jax.random.key(7), (2, 4), 0, 256)
    free = _greedy(model, prompt, 6)
    stop = int(free[0, 2])
    stopped = _greedy(model, prompt, 6, stop_tokens=[stop])
    for row in range(2):
        hits = np.flatnonzero(free[row] == stop)
        end = hits[0] + 1 if hits.size else 6
        np.testing.assert_array_equal(stopped[row, :end], free[row, :end])
        assert (stopped[row, end:] == stop).all()


def test_top_k_1_and_a_tiny_top_p_sample_the_most_likely_token():
    model = _small_model()
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    greedy = _greedy(model, prompt, 4)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = model.generate(prompt, 4, temperature=1.0, rng=jax.random.key(1), **kw)
        np.testing.assert_array_equal(sampled, greedy)


def test_one_new_token_is_the_prefill_s_and_a_tiny_temperature_is_greedy():
    model = _small_model()
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    greedy = _greedy(model, prompt, 3)
    np.testing.assert_array_equal(_greedy(model, prompt, 1), greedy[:, :1])
    cold = model.generate(prompt, 3, temperature=1e-30, top_p=0.9, rng=jax.random.key(2))
    np.testing.assert_array_equal(cold, greedy)  # no overflow to NaN probabilities


def test_sample_token_keeps_the_top_k_and_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(8), 2)
    top2 = np.asarray(generation.sample_token(logits, keys[0], top_k=2))
    assert set(top2) == {0, 1}
    nucleus = np.asarray(generation.sample_token(logits, keys[1], top_p=0.7))  # 0.5 + 0.3 reach it
    assert set(nucleus) == {0, 1} and abs((nucleus == 0).mean() - 0.5 / 0.8) < 0.05


def test_sample_token_draws_each_row_by_its_index_in_the_batch():
    """A batch sampled in slices (each with its first row's index) gives the whole batch's
    tokens: what a device of a data-parallel `generate` relies on. Different rows with the same
    logits draw different noise."""
    logits = jax.random.normal(jax.random.key(9), (12, 50))
    key = jax.random.key(10)
    whole = np.asarray(generation.sample_token(logits, key, top_k=20))
    slices = [generation.sample_token(logits[i:i + 4], key, top_k=20, first_row=jnp.int32(i))
              for i in range(0, 12, 4)]
    np.testing.assert_array_equal(np.concatenate(slices), whole)
    same = np.asarray(generation.sample_token(jnp.zeros((400, 50)), key))
    assert len(set(same)) > 30


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_the_decode_loop_copies_no_cache(ssm_dtype):
    """`generate` compiles to one call whose while loop carries the KV caches and the Mamba2
    states (float32 or bf16): no copy of a cache-sized buffer inside the loop."""
    model = _small_model()
    graphdef, state = nnx.split(model)
    prompt = jnp.ones((2, 5), jnp.int32)
    hlo = jax.jit(lambda state: nnx.merge(graphdef, state).generate(
        prompt, 7, temperature=0.0, rng=jax.random.key(0), ssm_dtype=ssm_dtype)).lower(
        state).compile().as_text()
    kv_shape = "f32[2,16,1,16]"  # (B, capacity 5 + 7 -> 16, K, H)
    state_shape = ("f32" if ssm_dtype == "float32" else "bf16") + "[2,4,16,16]"  # (B, H, P, N)
    assert kv_shape in hlo and state_shape in hlo and " while(" in hlo
    body = _while_body(hlo)
    copies = [line for line in body if " copy(" in line and (kv_shape in line or
                                                             state_shape in line)]
    assert not copies, copies


def test_the_decode_loop_reads_the_weights_in_the_compute_dtype():
    """A bf16 model's float32 matmul weights are cast once, before the prefill: no convert of a
    weight inside the decode loop (XLA on GPU would run it at every step)."""
    config = HybridLMConfig(**SMALL, implementation="xla", dtype=jnp.bfloat16)
    graphdef, state = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
    prompt = jnp.ones((2, 5), jnp.int32)
    hlo = jax.jit(lambda state: nnx.merge(graphdef, state).generate(
        prompt, 7, temperature=0.0, rng=jax.random.key(0))).lower(state).as_text(dialect="hlo")
    weights = {"bf16[" + ",".join(map(str, leaf.shape)) + "]"
               for path, leaf in jax.tree_util.tree_leaves_with_path(state)
               if re.search(r"\['(kernel|embedding)'\]", jax.tree_util.keystr(path))}
    assert len(weights) >= 4
    converts = [line for line in _while_body(hlo) if " convert(" in line
                and any(f"= {shape}" in line for shape in weights)]
    assert not converts, converts


def _while_body(hlo):
    """The lines of the computations the HLO module's while loops run (bodies, and what they
    call)."""
    computations, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            computations[name] = []
        elif name:
            computations[name].append(line)
    todo = [b for lines in computations.values() for line in lines if " while(" in line
            for b in re.findall(r"body=%?([\w.\-]+)", line)]
    seen = set()
    while todo:
        current = todo.pop()
        if current in seen or current not in computations:
            continue
        seen.add(current)
        for line in computations[current]:
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
    return [line for c in seen for line in computations[c]]


def test_remat_recomputes_the_blocks_and_changes_no_gradient():
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, 256)

    def loss_and_grads(config):
        graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))

        def loss(params):
            return nnx.merge(graphdef, params)(tokens).mean()

        # One trace gives both the jaxpr and the compiled gradient (jit: no op-by-op dispatch).
        traced = jax.jit(jax.value_and_grad(loss)).trace(params)
        return traced.lower().compile()(params), str(traced.jaxpr)

    config = HybridLMConfig(**SMALL, implementation="xla")
    (loss, grads), jaxpr = loss_and_grads(config)
    (loss_remat, grads_remat), jaxpr_remat = loss_and_grads(
        dataclasses.replace(config, remat=True))
    assert "remat" not in jaxpr and "remat" in jaxpr_remat
    _close(loss, loss_remat, 1e-6)
    for g, g_remat in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat), strict=True):
        _close(g, g_remat, 1e-6)


def test_cudnn_attention_decodes_through_the_kernels():
    """attention_implementation="cudnn" runs jax.nn's cuDNN attention in the forward (a GPU's);
    jax.nn has no KV cache, so generate's prefill and decode steps run the kernels."""
    config = HybridLMConfig(**SMALL, implementation="xla", attention_implementation="cudnn")
    model = HybridLM(config, rngs=nnx.Rngs(0))
    assert model.shared.attention.implementation == "cudnn"
    prompt = jax.random.randint(jax.random.key(4), (2, 5), 0, 256)
    tokens = model.generate(prompt, 3, temperature=0.0, rng=jax.random.key(0))
    reference = _small_model().generate(prompt, 3, temperature=0.0, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(reference))
