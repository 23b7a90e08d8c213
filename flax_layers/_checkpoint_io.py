"""Checkpoints in Hugging Face's layout, read into numpy and written back.

A source is a directory (config.json and safetensors: one `model.safetensors`, or shards
listed in `model.safetensors.index.json`; or a torch `pytorch_model.bin`), a single
`.safetensors` or torch file, or a state dict in memory (a mapping of names to numpy arrays
or torch tensors). Torch files and tensors need torch, which this package does not depend on.
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_NAMES = ("pytorch_model.bin", "model.pt", "model.pth")


def read_checkpoint(source: str | os.PathLike | Mapping[str, Any],
                    ) -> tuple[dict | None, dict[str, np.ndarray]]:
    """(config.json's dict, or None where the source has none; tensors by name)."""
    if isinstance(source, Mapping):
        return None, {str(name): _numpy(value) for name, value in source.items()}
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"a checkpoint must be a path or a state dict (a mapping of names to "
                        f"arrays), got {type(source).__name__}")
    path = pathlib.Path(source)
    if path.is_file():
        config_path = path.parent / CONFIG_NAME
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        return config, _read_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    config_path = path / CONFIG_NAME
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    if (path / SAFETENSORS_INDEX).is_file():
        shards = sorted(set(json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
                            .values()))
        tensors = {}
        for shard in shards:
            tensors.update(_read_file(path / shard))
        return config, tensors
    for name in (SAFETENSORS_NAME, *TORCH_NAMES):
        if (path / name).is_file():
            return config, _read_file(path / name)
    found = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(f"{path} holds no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX} or "
                            f"{' / '.join(TORCH_NAMES)}; it holds {found}")


def save_pretrained(model, directory: str | os.PathLike, dtype=None) -> str:
    """`model.save_pretrained`: its config (`config.to_transformers`) as config.json and its
    `state_dict` as model.safetensors (with transformers' `format: pt` metadata), in `dtype`
    (default: the source checkpoint's, `source_dtype`), into `directory` (made if missing);
    returns its path."""
    from safetensors.numpy import save_file

    dtype = jnp.dtype(dtype or source_dtype(model.config))
    config, tensors = model.config.to_transformers(dtype), model.state_dict(dtype=dtype)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
              directory / SAFETENSORS_NAME, metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(directory)


def _read_file(path):
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(path)
    try:
        import torch
    except ImportError as error:
        raise ImportError(f"reading the torch file {path} needs torch; convert it to "
                          "safetensors, or install torch") from error
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {name: _numpy(value) for name, value in state.items()}


def _numpy(value):
    """A numpy array of the same dtype and bits (torch's bfloat16 included)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            import torch

            return value.view(dtype=torch.int16).numpy().view(jnp.bfloat16)
        return value.numpy()
    return np.asarray(value)


class TensorReader:
    """Takes a checkpoint's tensors by name, checking each one's shape, and finally that every
    tensor was taken: a name the model does not know is an error, not silently dropped."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str):
        self.tensors, self.source, self.taken = dict(tensors), source, set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            near = sorted(n for n in self.tensors
                          if name.startswith(n.rsplit(".", 1)[0] + "."))[:3]
            raise KeyError(f"{self.source} has no tensor {name!r}"
                           + (f" (it has {near})" if near else ""))
        value = self.tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{self.source}: {name} has shape {tuple(value.shape)}, the model "
                             f"needs {tuple(shape)}")
        self.taken.add(name)
        return value

    def tied(self, copy: str, original: str) -> None:
        """`copy`, where the checkpoint holds it, must equal `original` (a tied weight saved
        twice): a copy that differs is an error, not silently dropped."""
        if copy not in self.tensors:
            return
        if not np.array_equal(self.tensors[copy], self.tensors.get(original)):
            raise ValueError(f"{self.source}: {copy} should be a tied copy of {original}, but "
                             "their values differ")
        self.taken.add(copy)

    def finish(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            raise ValueError(f"{self.source} has {len(left)} tensors the model does not use, "
                             f"e.g. {left[:4]}: a different architecture or configuration?")


# ---------------------------------------------------------------------------------------------
# Parameters of the shared layers in transformers' (torch) layouts: a Linear's weight is
# (out, in), where nnx's kernel is (in, out) (LinearGeneral: the in and out axes unflattened).


def source_dtype(config) -> jnp.dtype:
    """The dtype a model config's source config.json recorded (transformers' `dtype` or
    `torch_dtype`), else float32: what an export writes by default."""
    source = json.loads(config.source) if config.source else {}
    return jnp.dtype(source.get("dtype") or source.get("torch_dtype") or "float32")


def number(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def json_number(value: float) -> Any:
    """`number`'s inverse: infinities as transformers writes them."""
    return {"__float__": "Infinity" if value > 0 else "-Infinity"} if np.isinf(value) else value


def set_param(variable, value: np.ndarray) -> None:
    """A parameter's value from a checkpoint tensor of its shape, in the parameter's dtype."""
    if tuple(variable.shape) != tuple(value.shape):
        raise ValueError(f"shape {tuple(value.shape)} for a parameter of shape "
                         f"{tuple(variable.shape)}")
    variable.set_value(jnp.asarray(value, variable.dtype))


def array(variable, dtype) -> np.ndarray:
    return np.asarray(jnp.asarray(variable[...], dtype))


def load_linear(reader: TensorReader, name: str, linear, in_axes: int = 1) -> None:
    """`name`.weight (out, in) (and `name`.bias where the layer has one) into an nnx Linear or
    LinearGeneral whose kernel's first `in_axes` axes are its inputs."""
    kernel_shape = tuple(linear.kernel.shape)
    fan_in = int(np.prod(kernel_shape[:in_axes]))
    fan_out = int(np.prod(kernel_shape[in_axes:]))
    weight = reader.take(f"{name}.weight", (fan_out, fan_in))
    set_param(linear.kernel, weight.T.reshape(kernel_shape))
    if getattr(linear, "bias", None) is not None:
        set_param(linear.bias, reader.take(f"{name}.bias", (fan_out,)).reshape(linear.bias.shape))


def export_linear(out: dict, name: str, linear, dtype, in_axes: int = 1) -> None:
    kernel = array(linear.kernel, dtype)
    fan_in = int(np.prod(kernel.shape[:in_axes]))
    out[f"{name}.weight"] = np.ascontiguousarray(kernel.reshape(fan_in, -1).T)
    if getattr(linear, "bias", None) is not None:
        out[f"{name}.bias"] = array(linear.bias, dtype).reshape(-1)


def load_norm(reader: TensorReader, name: str, norm) -> None:
    set_param(norm.scale, reader.take(f"{name}.weight", tuple(norm.scale.shape)))


def export_norm(out: dict, name: str, norm, dtype) -> None:
    out[f"{name}.weight"] = array(norm.scale, dtype)


def load_mixer(reader: TensorReader, prefix: str, mixer) -> None:
    """A `flax_layers.Mamba2` from mamba_ssm's (and transformers') names under `prefix`."""
    load_linear(reader, f"{prefix}.in_proj", mixer.in_proj)
    load_linear(reader, f"{prefix}.out_proj", mixer.out_proj)
    width, channels = mixer.conv_weight.shape
    conv = reader.take(f"{prefix}.conv1d.weight", (channels, 1, width))
    set_param(mixer.conv_weight, conv[:, 0].T)
    if mixer.conv_bias is not None:
        set_param(mixer.conv_bias, reader.take(f"{prefix}.conv1d.bias", (channels,)))
    for name in ("dt_bias", "A_log", "D"):
        variable = getattr(mixer, name)
        set_param(variable, reader.take(f"{prefix}.{name}", tuple(variable.shape)))
    if mixer.norm_weight is not None:
        set_param(mixer.norm_weight, reader.take(f"{prefix}.norm.weight",
                                                 tuple(mixer.norm_weight.shape)))


def export_mixer(out: dict, prefix: str, mixer, dtype) -> None:
    export_linear(out, f"{prefix}.in_proj", mixer.in_proj, dtype)
    export_linear(out, f"{prefix}.out_proj", mixer.out_proj, dtype)
    out[f"{prefix}.conv1d.weight"] = np.ascontiguousarray(
        array(mixer.conv_weight, dtype).T[:, None, :])
    if mixer.conv_bias is not None:
        out[f"{prefix}.conv1d.bias"] = array(mixer.conv_bias, dtype)
    for name in ("dt_bias", "A_log", "D"):
        out[f"{prefix}.{name}"] = array(getattr(mixer, name), dtype)
    if mixer.norm_weight is not None:
        out[f"{prefix}.norm.weight"] = array(mixer.norm_weight, dtype)


def load_embedding(reader: TensorReader, name: str, embed) -> None:
    set_param(embed.embedding, reader.take(f"{name}.weight", tuple(embed.embedding.shape)))


def export_embedding(out: dict, name: str, embed, dtype) -> None:
    out[f"{name}.weight"] = array(embed.embedding, dtype)


# What a model's `_tensors()` walk names: (checkpoint name, module, kind).
_LOADERS = {
    "embedding": load_embedding, "norm": load_norm, "mixer": load_mixer,
    "linear": load_linear,
    "linear_heads_in": lambda reader, name, module: load_linear(reader, name, module, 2),
}
_EXPORTERS = {
    "embedding": export_embedding, "norm": export_norm, "mixer": export_mixer,
    "linear": export_linear,
    "linear_heads_in": lambda out, name, module, dtype: export_linear(out, name, module, dtype,
                                                                      2),
}


def load_tensors(reader: TensorReader, walk: Iterable[tuple[str, Any, str]]) -> None:
    """Every (name, module, kind) of a model's walk from the checkpoint: "embedding" (an nnx
    Embed), "norm" (RMSNorm), "mixer" (`flax_layers.Mamba2`), "linear" (Linear or
    LinearGeneral, inputs first) or "linear_heads_in" (LinearGeneral over (heads, head_dim))."""
    for name, module, kind in walk:
        _LOADERS[kind](reader, name, module)


def export_tensors(walk: Iterable[tuple[str, Any, str]], dtype) -> dict[str, np.ndarray]:
    """`load_tensors`' inverse: the walk's tensors in `dtype`, by name."""
    out = {}
    for name, module, kind in walk:
        _EXPORTERS[kind](out, name, module, dtype)
    return out


def check_all_set(model) -> None:
    """A ValueError naming a parameter the checkpoint did not give (still abstract)."""
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if isinstance(variable.get_value(), jax.ShapeDtypeStruct):
            raise ValueError(f"the checkpoint gave no value for {'.'.join(map(str, path))}")


def from_pretrained(model_class, config_class, source, config, param_dtype, overrides):
    """`model_class.from_pretrained`: the config from the source's config.json (or `config`),
    `overrides` replacing its fields; the model built abstractly (no random initialisation),
    then every parameter from the checkpoint by the model's `_load(reader)`, every tensor
    used and every parameter given."""
    found, tensors = read_checkpoint(source)
    if config is None:
        if found is None:
            raise ValueError("the checkpoint has no config.json: pass config=")
        if not (found.get("dtype") or found.get("torch_dtype")):  # mamba_ssm's: the tensors'
            floating = [v.dtype for v in tensors.values() if jnp.issubdtype(v.dtype, jnp.floating)]
            if floating:
                found = {**found, "dtype": max(set(floating), key=floating.count).name}
        config = config_class.from_dict(found, **overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    model = nnx.eval_shape(lambda: model_class(config, param_dtype=param_dtype,
                                               rngs=nnx.Rngs(0)))
    reader = TensorReader(tensors, "the state dict" if isinstance(source, Mapping)
                          else str(source))
    model._load(reader)
    reader.finish()
    check_all_set(model)
    return model
