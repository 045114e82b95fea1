"""The shape of a decoder-only model, read from its config.json alone (no weights are loaded).

A `ModelShape` holds the sizes the memory and compute models need: vocabulary, hidden size,
MLP width, layers, attention and key/value heads, head dimension, tied head, biases. It comes
from a local model folder's config.json, a hub id (only config.json is fetched, when the network
allows), or a preset (`presets.json`: published config.json values of common sizes, so that
`tunekit plan model.preset=llama-3-70b` needs neither the hub nor the weights).

Llama-style blocks are assumed (RMSNorm, q/k/v/o attention with grouped key/value heads, gated
SiLU MLP gate/up/down), which covers Llama 2/3, Mistral, SmolLM2 and the default model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

from tunekit import TunekitError

PRESETS_FILE = Path(__file__).with_name("presets.json")
# The linear projections of one block, in forward order: name -> (in, out) in terms of the shape.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style causal LM. All counts are elements, not bytes."""

    vocab_size: int
    hidden_size: int  # d
    intermediate_size: int  # m, the MLP width
    num_layers: int  # L
    num_heads: int  # h
    num_kv_heads: int  # h_kv (grouped-query attention when < h)
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    name: str = "model"

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of one block's projection."""
        d, m = self.hidden_size, self.intermediate_size
        return {"q_proj": (d, self.q_dim), "k_proj": (d, self.kv_dim), "v_proj": (d, self.kv_dim),
                "o_proj": (self.q_dim, d), "gate_proj": (d, m), "up_proj": (d, m), "down_proj": (m, d)}[name]

    def projection_bias(self, name: str) -> bool:
        return self.attention_bias if name in ("q_proj", "k_proj", "v_proj", "o_proj") else self.mlp_bias

    @property
    def linear_params_per_layer(self) -> int:
        """Weights (and biases) of the seven projections of one block: what NF4 quantizes."""
        return sum(i * o + (o if self.projection_bias(n) else 0)
                   for n in PROJECTIONS for i, o in [self.projection(n)])

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size  # input and post-attention RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Output head weights stored separately from the embedding (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (self.embedding_params + self.head_params + self.hidden_size
                + self.num_layers * (self.linear_params_per_layer + self.norm_params_per_layer))

    def with_layers(self, num_layers: int, name: Optional[str] = None) -> "ModelShape":
        return replace(self, num_layers=num_layers, name=name or self.name)


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    """A ModelShape from the fields of a Hugging Face config.json (a dict)."""
    try:
        d = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        shape = ModelShape(
            vocab_size=int(cfg["vocab_size"]), hidden_size=d, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or d // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            name=name,
        )
    except KeyError as e:
        raise TunekitError(f"model: {name}: config.json has no {e.args[0]!r}; the planner needs a Llama-style "
                           "decoder (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
                           "vocab_size)") from None
    except (TypeError, ValueError) as e:
        raise TunekitError(f"model: {name}: config.json has a malformed size ({e})") from None
    return shape


@lru_cache(maxsize=1)
def _presets() -> dict:
    data = json.loads(PRESETS_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def preset_names() -> list[str]:
    return sorted(_presets())


def preset_shape(name: str) -> ModelShape:
    presets = _presets()
    if name not in presets:
        raise TunekitError(f"model.preset: unknown preset {name!r}; choose one of {preset_names()}")
    return shape_from_config(presets[name]["config"], name=name)


def preset_source(name: str) -> str:
    return _presets()[name]["source"]


def read_config_json(path: str, key: str = "model.path") -> dict:
    """config.json of a local model folder, or of a hub id (config.json only, never weights)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        file = folder / "config.json"
        if not file.is_file():
            raise TunekitError(f"{key}: {path} is a folder but has no config.json (not a HF model folder)")
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise TunekitError(f"{key}: {file} is not valid JSON ({e})") from None
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(path, "config.json")).read_text())
    except Exception as e:  # offline, unknown repo, gated repo: all mean "cannot read it"
        raise TunekitError(f"{key}: cannot read config.json of {path!r} ({type(e).__name__}; offline?); pass a "
                           f"local model folder or model.preset= one of {preset_names()}") from None


def model_shape(path: Optional[str], preset: Optional[str], key: str = "model.path") -> ModelShape:
    """The shape of model.path (null = the embedded default model) or of model.preset."""
    if preset is not None:
        return preset_shape(preset)
    if path is None:
        return preset_shape("smollm2-135m")  # the embedded default model's config.json
    return shape_from_config(read_config_json(path, key), name=Path(path).name or path)


def student_shape(teacher: ModelShape, keep_every: int) -> ModelShape:
    """The half-depth (or 1/k-depth) student that distill.student_keep_every builds: layers 0, k, 2k, ..."""
    return teacher.with_layers(len(range(0, teacher.num_layers, keep_every)), name=f"{teacher.name} (every {keep_every})")
