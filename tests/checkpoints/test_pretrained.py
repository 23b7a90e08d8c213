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
    got = np.asarray(model(jnp.asarray(expected[f"tokens_{t}"])))
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
