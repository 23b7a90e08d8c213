"""HybridLM on 8 (simulated) devices: a train step's loss and every gradient on meshes with
Explicit axes (batch over data, sequence over context, both; parameters over fsdp and tensor)
equal one device's; the Mamba2 conv's history crosses sequence shards; the training example
runs on a mesh and resumes on another; errors name what cannot be honoured.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (`.ci/run` does).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_cases import mesh
from numerics import rel_error

import flax_layers
import pallas_kernels
from flax_layers import HybridLM, HybridLMConfig

pytestmark = pytest.mark.multidevice

CONFIG = HybridLMConfig.preset("tiny", chunk_size=16)


def _loss(model, tokens, segment_ids):
    logits = model(tokens, segment_ids=segment_ids)  # over tensor: the vocabulary sharded
    picked = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == tokens[..., None], logits, 0),
                     axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _segments(batch, t):
    """Three packed documents per row, their edges off the shards' edges."""
    ids = np.zeros((batch, t), np.int32)
    ids[:, 20:] = 1
    ids[:, 50:] = 2
    return jnp.asarray(ids)


@pytest.mark.parametrize("shape, names, spec, implementation, strategy, order, with_segments", [
    # Batch-only sharding is in the fully sharded test below and in the example's test.
    pytest.param((2, 4), ("data", "context"), P("data", "context"), "pallas", "all_gather",
                 "contiguous", True, id="data2-context4-segments-pallas"),
    pytest.param((2, 4), ("data", "context"), P("data", "context"), "xla", "ring", "zigzag",
                 True, id="data2-context4-zigzag-ring-segments-xla"),
])
def test_train_step_equals_one_device(shape, names, spec, implementation, strategy, order,
                                      with_segments):
    """In zig-zag order the tokens and segment ids are reordered once, before the model; the
    loss (a mean over tokens) and the gradients do not depend on the order."""
    config = dataclasses.replace(CONFIG, implementation=implementation,
                                 context_parallelism=strategy)
    model = HybridLM(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 64), 0, config.vocab_size)
    segments = _segments(*tokens.shape) if with_segments else None
    step = nnx.jit(nnx.value_and_grad(_loss))
    want_loss, want_grads = step(model, tokens, segments)

    mesh_ = mesh(shape, names, explicit=True)
    parts = mesh_.shape.get("context", 1)
    if order == "zigzag":
        model = HybridLM(dataclasses.replace(config, sequence_order=order), rngs=nnx.Rngs(0))
        tokens, segments = (None if x is None else pallas_kernels.zigzag(x, parts)
                            for x in (tokens, segments))
    with jax.set_mesh(mesh_):
        placed = [None if x is None else jax.device_put(x, spec) for x in (tokens, segments)]
        loss, grads = step(model, *placed)
    assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
    for path, got in nnx.to_flat_state(grads):
        want = dict(nnx.to_flat_state(want_grads))[path]
        assert rel_error(got[...], want[...]) < 1e-5, path


def test_fully_sharded_tensor_parallel_train_step_equals_one_device():
    """Parameters sharded by `parameter_shardings` (the embedding dimension over fsdp, heads,
    MLP units and vocabulary over tensor), the fsdp shards gathered at the step's start: the
    gradients come back sharded as the parameters."""
    graphdef, params = nnx.split(HybridLM(dataclasses.replace(CONFIG, implementation="pallas"),
                                          rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (8, 64), 0, CONFIG.vocab_size)

    def loss(params, tokens):
        model = nnx.merge(graphdef, flax_layers.gather_parameters(params))
        return _loss(model, tokens, None)

    step = jax.jit(jax.value_and_grad(loss))
    want_loss, want_grads = step(params, tokens)
    mesh_ = mesh((2, 2, 2), ("data", "fsdp", "tensor"), explicit=True)
    shardings = flax_layers.parameter_shardings(params, mesh_)
    with jax.set_mesh(mesh_):
        loss_, grads = step(jax.device_put(params, shardings),
                            jax.device_put(tokens, P(("data", "fsdp"))))
    assert abs(float(loss_) - float(want_loss)) < 1e-5 * float(want_loss)
    specs = {str(path): s.spec for path, s in nnx.to_flat_state(shardings)}
    assert specs["('embed', 'embedding')"] == P("tensor", "fsdp")
    assert specs["('blocks', 0, 'mixer', 'in_proj', 'kernel')"] == P("fsdp", None)
    assert specs["('blocks', 0, 'mixer', 'A_log')"] == P("tensor")
    assert specs["('shared', 'attention', 'key', 'kernel')"] == P("fsdp", "tensor", None)
    assert specs["('shared', 'down', 'kernel')"] == P("tensor", "fsdp")
    want = dict(nnx.to_flat_state(want_grads))
    for path, got in nnx.to_flat_state(grads):
        assert jax.typeof(got[...]).sharding.spec == specs[str(path)], path
        assert rel_error(got[...], want[path][...]) < 1e-5, path


def test_decoding_takes_whole_parameters():
    """On a tensor mesh: from tensor-sharded parameters `generate` says what to do; from
    parameters gathered whole it samples one device's tokens."""
    graphdef, params = nnx.split(HybridLM(dataclasses.replace(CONFIG, implementation="xla"),
                                          rngs=nnx.Rngs(0)))
    prompt, key = jnp.arange(10, dtype=jnp.int32)[None], jax.random.key(0)
    want = nnx.merge(graphdef, params).generate(prompt, 3, temperature=0, rng=key)
    mesh_ = mesh((4, 2), ("data", "tensor"), explicit=True)
    with jax.set_mesh(mesh_):
        placed = jax.device_put(params, flax_layers.parameter_shardings(params, mesh_))
        sharded = nnx.merge(graphdef, flax_layers.gather_parameters(placed))
        with pytest.raises(ValueError, match=r"decode=True needs whole parameters; .* are "
                                             r"sharded: .*gather_parameters\(state, axes=None\)"):
            sharded.generate(prompt, 3, temperature=0, rng=key)
        whole = nnx.merge(graphdef, flax_layers.gather_parameters(placed, axes=None))
        got = whole.generate(prompt, 3, temperature=0, rng=key)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape, names, rows, implementation, options", [
    pytest.param((8,), ("data",), "data", "xla", dict(temperature=0.0), id="data8-greedy-xla"),
    pytest.param((4, 2), ("data", "tensor"), "data", "xla", dict(temperature=1.0, top_k=8),
                 id="data4-of-data4-tensor2-sampled-xla"),
    pytest.param((4, 2), ("data", "fsdp"), ("data", "fsdp"), "pallas",
                 dict(temperature=0.8, top_k=5, top_p=0.9, kv_dtype="int8", page_size=16,
                      ssm_dtype="bfloat16", prefill_tokens=10, stop_tokens=[3]),
                 id="data4-fsdp2-sampled-int8-paged-pallas"),
])
def test_generate_splits_the_rows_over_devices(shape, names, rows, implementation, options):
    """A prompt whose rows are split over a mesh generates data-parallel (each device prefills
    and decodes its rows): the tokens of one device's run, split as the prompt, sampling
    included (each row's noise comes from its index in the batch); ragged prompts, stop
    tokens, paged 8-bit caches and the prefill in groups run per device."""
    graphdef, params = nnx.split(HybridLM(
        dataclasses.replace(CONFIG, implementation=implementation), rngs=nnx.Rngs(0)))
    prompt = jax.random.randint(jax.random.key(5), (16, 9), 0, CONFIG.vocab_size)
    lengths = jax.random.randint(jax.random.key(6), (16,), 1, 10)
    kwargs = dict(prompt_lengths=lengths, rng=jax.random.key(7), **options)
    want = nnx.merge(graphdef, params).generate(prompt, 6, **kwargs)
    mesh_ = mesh(shape, names, explicit=True)
    with jax.set_mesh(mesh_):  # the parameters replicated on the mesh, as the docstring asks
        model = nnx.merge(graphdef, jax.device_put(params, NamedSharding(mesh_, P())))
        got = model.generate(jax.device_put(prompt, P(rows)), 6, **kwargs)
    assert jax.typeof(got).sharding.spec == P(rows, None)
    np.testing.assert_array_equal(got, want)


def test_generate_splits_only_the_rows_and_takes_whole_parameters():
    graphdef, params = nnx.split(HybridLM(dataclasses.replace(CONFIG, implementation="xla"),
                                          rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, params)
    with (jax.set_mesh(mesh((8,), ("data",), explicit=True)),
          pytest.raises(ValueError, match=r"prompt_tokens: only its rows may be split")):
        model.generate(jax.device_put(jnp.zeros((8, 8), jnp.int32), P(None, "data")), 2,
                       rng=jax.random.key(0))
    mesh_ = mesh((4, 2), ("data", "tensor"), explicit=True)
    with (jax.set_mesh(mesh_),
          pytest.raises(ValueError, match=r"needs whole parameters; .* are sharded")):
        sharded = nnx.merge(graphdef, jax.device_put(
            params, flax_layers.parameter_shardings(params, mesh_)))
        sharded.generate(jax.device_put(jnp.zeros((8, 8), jnp.int32), P("data")), 2,
                         rng=jax.random.key(0))


def test_the_conv_history_must_fit_in_a_sequence_shard():
    model = HybridLM(dataclasses.replace(CONFIG, implementation="xla"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 16), jnp.int32)  # 2 tokens per device, the conv needs 3
    needle = r"the sequence shards \(2 tokens over mesh axis 'context'\) must hold at least"
    with (jax.set_mesh(mesh((8,), ("context",), explicit=True)),
          pytest.raises(ValueError, match=needle + " the conv's 3")):
        model(jax.device_put(tokens, P(None, "context")))


def test_context_parallelism_and_order_are_checked_on_construction():
    with pytest.raises(ValueError, match="context_parallelism must be one of"):
        dataclasses.replace(CONFIG, context_parallelism="ulysses")
    with pytest.raises(ValueError, match="sequence_order must be one of"):
        dataclasses.replace(CONFIG, sequence_order="striped")


def test_zigzag_order_needs_two_pieces_per_device():
    model = HybridLM(dataclasses.replace(CONFIG, implementation="xla", sequence_order="zigzag"),
                     rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 40), jnp.int32)  # 5 tokens per device: not two equal halves
    needle = r"the sequence \(40\) does not split into 16 equal pieces over mesh axis 'context'"
    with (jax.set_mesh(mesh((8,), ("context",), explicit=True)),
          pytest.raises(ValueError, match=needle)):
        model(jax.device_put(tokens, P(None, "context")))


def test_training_example_on_a_mesh_resumes_on_another_and_matches_one_device(tmp_path):
    """examples/train_hybrid_lm.py: 4 steps on one device; 2 on --mesh fsdp=4,context=2
    (parameters and optimizer state sharded, checkpoint too) and, from their checkpoint, 2 more
    on --mesh data=2,tensor=2,context=2 with ring attention: the same losses."""
    from test_train_example import TINY, trainer

    flags = [*TINY, "--sample-tokens", "0", "--eval-batches", "1", "--checkpoint-every", "2",
             "--schedule-steps", "4"]

    def losses(workdir):
        return [r["loss"] for r in trainer.read_metrics(workdir / "metrics.jsonl")]

    trainer.train(trainer.parse_args([*flags, "--workdir", str(tmp_path / "one"), "--steps",
                                      "4", "--mesh", "data=1"]))
    meshes = tmp_path / "meshes"
    first = trainer.train(trainer.parse_args([*flags, "--workdir", str(meshes), "--steps", "2",
                                              "--mesh", "fsdp=4,context=2"]))
    assert first["model"].embed.embedding[...].sharding.spec == P(None, "fsdp")
    trainer.train(trainer.parse_args([*flags, "--workdir", str(meshes), "--steps", "4",
                                      "--resume", "--mesh", "data=2,tensor=2,context=2",
                                      "--context-parallelism", "ring"]))
    want, got = losses(tmp_path / "one"), losses(meshes)
    assert len(got) == len(want) == 5
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("mesh_flag, message", [
    ("data=16", "needs 16 devices; 8 are here"),
    ("data=2,fsdp=4", "--batch-size 4 does not split over 8 data and fsdp devices (--mesh)"),
    ("context=8", "--seq-len 16 does not split over 8 context devices (--mesh) into pieces of "
                  "at least 3 tokens"),
    ("tensor=4", "the model's 2 attention kv heads do not split over 4 tensor devices (--mesh)"),
])
def test_training_example_mesh_errors(mesh_flag, message, tmp_path):
    from test_train_example import TINY, trainer

    with pytest.raises(trainer.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trainer.setup(trainer.parse_args([*TINY, "--seq-len", "16", "--workdir", str(tmp_path),
                                          "--mesh", mesh_flag]))
