"""Mamba2LM and Zamba2LM against transformers' Mamba2ForCausalLM and Zamba2ForCausalLM: tiny
random checkpoints saved by transformers (fixtures/, made by make_fixtures.py) load, give its
float32 logits (T = 1, 37 and 200: chunk 32, so odd tails) through the jnp reference and the
kernels (interpret mode on a CPU), the same 20 greedy tokens, and export back bit for bit."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from flax_layers import Mamba2LM, Mamba2LMConfig, Zamba2Config, Zamba2LM

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MODELS = {"mamba2": Mamba2LM, "zamba2": Zamba2LM}


def _expected(name):
    return np.load(FIXTURES / name / "expected.npz")


@pytest.fixture(scope="module", params=[(name, impl) for name in MODELS
                                        for impl in ("xla", "pallas")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request):
    name, implementation = request.param
    return name, MODELS[name].from_pretrained(FIXTURES / name, implementation=implementation)


@pytest.mark.parametrize("t", [1, 37, 200])
def test_logits_match_transformers(loaded, t):
    name, model = loaded
    expected = _expected(name)
    want = expected[f"logits_{t}"]
    got = np.asarray(nnx.jit(lambda model, tokens: model(tokens))(
        model, jnp.asarray(expected[f"tokens_{t}"])))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_less(np.abs(got - want).max(), 1e-4 * np.abs(want).max())


def test_greedy_generation_matches_transformers(loaded):
    name, model = loaded
    expected = _expected(name)
    tokens = model.generate(jnp.asarray(expected["prompt"]), 20, temperature=0.0,
                            rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tokens), expected["greedy_20"])
    np.testing.assert_array_equal(expected["hf_generate_20"], expected["greedy_20"])


@pytest.mark.parametrize("name", list(MODELS))
def test_export_gives_back_the_checkpoint_bit_for_bit(name, tmp_path):
    source = load_file(FIXTURES / name / "model.safetensors")
    model = MODELS[name].from_pretrained(FIXTURES / name)
    exported = model.state_dict()
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype, key
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    model.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    assert all(np.array_equal(written[k], v) for k, v in source.items())
    config = json.loads((FIXTURES / name / "config.json").read_text())
    again = json.loads((tmp_path / "config.json").read_text())
    assert {k: again.get(k) for k in config if k != "transformers_version"} == {
        k: v for k, v in config.items() if k != "transformers_version"}
    reloaded = MODELS[name].from_pretrained(tmp_path)
    assert reloaded.config == model.config


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_checkpoints_round_trip(name):
    source = {k: v.astype(jnp.bfloat16) for k, v in
              load_file(FIXTURES / name / "model.safetensors").items()}
    config_class = Mamba2LMConfig if name == "mamba2" else Zamba2Config
    config = config_class.from_dict(json.loads((FIXTURES / name / "config.json").read_text()))
    model = MODELS[name].from_pretrained(source, config=config)
    assert model.embed.embedding[...].dtype == jnp.float32  # parameters for training
    exported = model.state_dict(dtype=jnp.bfloat16)
    for key, value in source.items():
        np.testing.assert_array_equal(exported[key].view(np.uint16), value.view(np.uint16))


def test_mamba_ssm_names_and_config_load():
    hf = json.loads((FIXTURES / "mamba2" / "config.json").read_text())
    model = Mamba2LM.from_pretrained(FIXTURES / "mamba2")
    state = model.state_dict(names="mamba_ssm")
    assert "backbone.embedding.weight" in state
    mamba_ssm_config = dict(
        d_model=hf["hidden_size"], d_intermediate=0, n_layer=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"], rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
        pad_vocab_size_multiple=8, tie_embeddings=False,
        ssm_cfg=dict(layer="Mamba2", d_state=hf["state_size"], headdim=hf["head_dim"],
                     ngroups=hf["n_groups"], chunk_size=hf["chunk_size"]))
    config = Mamba2LMConfig.from_dict(mamba_ssm_config)
    again = Mamba2LM.from_pretrained(state, config=config)
    tokens = jnp.asarray(_expected("mamba2")["tokens_37"])
    np.testing.assert_array_equal(np.asarray(again(tokens)), np.asarray(model(tokens)))


def test_checkpoint_mismatches_name_the_tensor(tmp_path):
    source = load_file(FIXTURES / "mamba2" / "model.safetensors")
    config = Mamba2LMConfig.from_dict(json.loads((FIXTURES / "mamba2" / "config.json")
                                                 .read_text()))
    with pytest.raises(ValueError, match="no config.json"):
        Mamba2LM.from_pretrained(source)
    with pytest.raises(ValueError, match="does not use.*backbone.extra"):
        Mamba2LM.from_pretrained({**source, "backbone.extra": np.zeros(3)}, config=config)
    missing = dict(source)
    del missing["backbone.layers.1.mixer.D"]
    with pytest.raises(KeyError, match=r"backbone\.layers\.1\.mixer\.D"):
        Mamba2LM.from_pretrained(missing, config=config)
    with pytest.raises(ValueError, match="in_proj.weight has shape"):
        Mamba2LM.from_pretrained(source, config=config.__class__(
            **{**config.__dict__, "d_state": 8}))
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        Mamba2LM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'zamba2'"):
        Zamba2Config.from_dict({"model_type": "mamba2"})


def test_the_exported_checkpoint_gives_transformers_logits(tmp_path):
    """Where torch and transformers are at hand: our export, read by transformers, gives the
    fixture's logits (the round trip through their loader, not only ours)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name, torch_class in (("mamba2", "Mamba2ForCausalLM"), ("zamba2", "Zamba2ForCausalLM")):
        MODELS[name].from_pretrained(FIXTURES / name).save_pretrained(tmp_path / name)
        model = getattr(transformers, torch_class).from_pretrained(tmp_path / name).eval()
        expected = _expected(name)
        with torch.no_grad():
            logits = model(torch.as_tensor(expected["tokens_37"]), use_cache=False).logits
        np.testing.assert_allclose(logits.numpy(), expected["logits_37"], rtol=0, atol=1e-5)


def test_the_zamba2_1p2b_preset_has_its_published_size():
    config = Zamba2Config.preset("zamba2-1.2b")
    model = nnx.eval_shape(lambda: Zamba2LM(config, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert 1.20e9 < params < 1.24e9  # 1.22 B as published


def test_tied_copies_must_equal_what_they_copy():
    """A Zamba2 checkpoint may hold each later use's copy of a shared block (and a tied LM
    head): equal copies load, a differing one is an error, not silently dropped."""
    source = load_file(FIXTURES / "zamba2" / "model.safetensors")
    config = Zamba2Config.from_dict(json.loads((FIXTURES / "zamba2" / "config.json")
                                               .read_text()))
    # The third hybrid layer (4) uses block A, saved under the first (1).
    copies = {k.replace("layers.1.shared_transformer", "layers.4.shared_transformer"): v
              for k, v in source.items() if k.startswith("model.layers.1.shared_transformer")}
    tied = {**source, **copies, "lm_head.weight": source["model.embed_tokens.weight"]}
    tokens = jnp.asarray(_expected("zamba2")["tokens_37"])
    np.testing.assert_array_equal(
        np.asarray(Zamba2LM.from_pretrained(tied, config=config)(tokens)),
        np.asarray(Zamba2LM.from_pretrained(source, config=config)(tokens)))
    name = "model.layers.4.shared_transformer.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="tied copy of model.layers.1.shared_transformer"):
        Zamba2LM.from_pretrained({**tied, name: tied[name] + 1}, config=config)


def test_configs_transformers_would_build_otherwise_are_refused():
    config = json.loads((FIXTURES / "zamba2" / "config.json").read_text())
    with pytest.raises(ValueError, match="unties the shared blocks"):
        Zamba2Config.from_dict({**config, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="disagrees with layers_block_type"):
        Zamba2Config.from_dict({**config, "hybrid_layer_ids": [1, 3]})
    with pytest.raises(TypeError, match="norm_eps must be a number"):
        Zamba2Config(norm_eps=True)
    hf = json.loads((FIXTURES / "mamba2" / "config.json").read_text())
    with pytest.warns(UserWarning, match="n_groups=2: this Mamba2LM normalises"):
        Mamba2LMConfig.from_dict({**hf, "n_groups": 2})
    mamba_ssm = dict(d_model=32, n_layer=2, vocab_size=100, ssm_cfg={})
    with pytest.raises(ValueError, match="Mamba1"):  # mamba_ssm's default layer
        Mamba2LMConfig.from_dict(mamba_ssm)
    padded = Mamba2LMConfig.from_dict({**mamba_ssm, "ssm_cfg": {"layer": "Mamba2",
                                                                "headdim": 16}})
    assert padded.vocab_size == 104  # padded to mamba_ssm's default multiple of 8


def test_mamba_ssm_state_dicts_hold_a_tied_head_under_both_names():
    hf = json.loads((FIXTURES / "mamba2" / "config.json").read_text())
    source = load_file(FIXTURES / "mamba2" / "model.safetensors")
    del source["lm_head.weight"]
    model = Mamba2LM.from_pretrained(
        source, config=Mamba2LMConfig.from_dict({**hf, "tie_word_embeddings": True}),
        param_dtype=jnp.bfloat16)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        # the SSM's A_log, D and dt_bias stay float32, as mamba_ssm keeps them
        want = jnp.float32 if path[-1] in ("A_log", "D", "dt_bias") else jnp.bfloat16
        assert variable.get_value().dtype == want, path
    state = model.state_dict(names="mamba_ssm")
    np.testing.assert_array_equal(state["lm_head.weight"], state["backbone.embedding.weight"])
    assert "lm_head.weight" not in model.state_dict()


@pytest.mark.parametrize("name", list(MODELS))
def test_remat_recomputes_the_layers_and_changes_no_gradient(name):
    tokens = jnp.asarray(_expected(name)["tokens_37"])

    def loss_and_grads(remat):
        model = MODELS[name].from_pretrained(FIXTURES / name, implementation="xla", remat=remat)
        graphdef, params = nnx.split(model)

        def loss(params):
            return nnx.merge(graphdef, params)(tokens).mean()

        # One trace gives both the jaxpr and the compiled gradient (jit: no op-by-op dispatch).
        traced = jax.jit(jax.value_and_grad(loss)).trace(params)
        return traced.lower().compile()(params), str(traced.jaxpr)

    (loss, grads), jaxpr = loss_and_grads(False)
    (loss_remat, grads_remat), jaxpr_remat = loss_and_grads(True)
    assert "remat" not in jaxpr and "remat" in jaxpr_remat
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
    # Recomputing reorders float32 sums: entries that cancel differ by rounding at the scale
    # of the whole array (one of Zamba2's 1024 at 2.7e-5 of itself, 1e-6 of the array's
    # largest), so the tolerance is set by that scale.
    for g, g_remat in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat), strict=True):
        scale = float(np.max(np.abs(np.asarray(g)), initial=0.0))
        np.testing.assert_allclose(g_remat, g, rtol=1e-5, atol=1e-7 + 1e-6 * scale)
