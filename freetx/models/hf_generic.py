"""The generic transformers path: any causal LM transformers knows that freetx has no
native layout for (GPT-NeoX, Granite, StarCoder2, Phi-2, Gemma 1, ...), run by
transformers' own modules inside a freetx model.

`HFGenericModel` wraps `AutoModelForCausalLM.from_config(config, attn_implementation=
"sdpa")` (eager where the architecture has no sdpa), built on the meta device like every freetx model; its config
(`HFGenericConfig`) is the folder's whole config.json, so a checkpoint's meta.json
rebuilds it without the folder. It holds the HF model's children as its own, so its
parameter and module names are transformers' (`model.layers.0.self_attn.q_proj`):
tensor names are the folder's, LoRA targets and activation hooks are HF's names.
Its blocks are the classes the HF model names in `_no_split_modules` (FSDP2 shards
them, activation checkpointing recomputes them). Its HF layout (`GENERIC_LAYOUT`,
last in `freetx.models.hf.LAYOUTS`) keeps the folder's tensor names and writes
config.json back from the recorded dict.

A model type whose folders transformers converts when loading (MoE experts stored per
expert, held stacked: DeepSeek-V3, Qwen2-MoE, GLM-4.5, OLMoE, ...) is read by transformers'
own rules (`ConvertedNames`): each stored tensor lands in its row (and part) of the
fused parameter, so a rank reads its own experts only, and an export writes the stored
names back; a rule freetx does not stream is refused by name before a weight is read.
`transformers` is an optional extra (`pip install 'freetx[hf]'`).

Generation keeps transformers' own KV cache (`DynamicCache` for the model's config, as
transformers' `generate` makes it: sliding layers keep their window, linear-attention,
convolution and state-space layers their state) behind freetx's `DecodesIncrementally`
(`HFCache`), each step's inputs made by the model's own `prepare_inputs_for_generation`
with the attention mask and positions transformers' `generate` gives left-padded rows. A
model that cannot generate from that cache is refused it by name (`cache_problem`).
"""

from __future__ import annotations

import inspect
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from freetx.errors import CheckpointError, ConfigError
from freetx.models.decoder.estimate import decoder_activations
from freetx.models.decoder.layers import init_normal
from freetx.models.kv_cache import CachedRows
from freetx.models.memory import ActivationBytes, TrainingShape
from freetx.models.protocol import OutputLayer, OutputLoss

# tensors some folders carry that are not weights (older checkpoints' RoPE tables)
_NOT_WEIGHTS = (".rotary_emb.inv_freq", ".rotary_emb.original_inv_freq")


def require_transformers():
    """The `transformers` module, or a one-paragraph error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "this model's model_type has no native freetx layout, so freetx builds it "
            "through transformers (the generic path), which is not installed. Install it "
            "with pip install 'freetx[hf]'."
        ) from None
    return transformers


def transformers_causal_lm_types() -> tuple[str, ...]:
    """Every model_type transformers builds as a causal LM; () without transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return ()
    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@dataclass
class HFGenericConfig:
    """What rebuilds a generic model: the folder's config.json, as a dict, and the longest
    sequence a run trains on (default: the config's max_position_embeddings)."""

    hf_config: dict
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hf_config, dict) or "model_type" not in self.hf_config:
            raise ValueError("hf_config must be a config.json dict with its model_type")
        if self.max_seq_len is None:
            self.max_seq_len = int(
                self.hf_config.get("max_position_embeddings")
                or self.hf_config.get("n_positions")
                or 2048
            )
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be at least 1")

    @property
    def text_config(self) -> dict:
        """The language model's fields: a multimodal folder's `text_config` (Qwen3.5's
        `qwen3_5`), else the config itself."""
        return self.hf_config.get("text_config") or self.hf_config

    @property
    def hidden_dim(self) -> int:  # the residual width, named as the decoder's config names it
        return int(self.text_config.get("hidden_size") or self.text_config["n_embd"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    # the shape its activations are counted by (`activation_bytes`), as the decoder names it
    @property
    def num_heads(self) -> int:
        return int(self.text_config.get("num_attention_heads") or self.text_config["n_head"])

    @property
    def ffn_hidden_dim(self) -> int:
        return int(self.text_config.get("intermediate_size") or 4 * self.hidden_dim)


def build_hf(hf_config: dict[str, Any]) -> nn.Module:
    """transformers' causal LM of a config.json dict (on the current device: meta for a
    freetx model), or an error naming what the generic path cannot read."""
    transformers = require_transformers()
    config = _transformers_config(transformers, hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(  # in torch's default dtype, as every
        config, attn_implementation=attention(config), dtype=torch.get_default_dtype()
    )  # freetx model (not config.json's: mixed precision is the run's choice)
    converted_names(hf, hf_config)  # refuses a rule freetx does not read
    if next(hf.parameters(recurse=False), None) is not None:
        raise CheckpointError(
            f"{type(hf).__name__} holds parameters outside its submodules, which the "
            f"generic transformers path does not read; no native freetx layout reads "
            f"'{hf_config['model_type']}' yet: see docs/models.md for the types freetx trains."
        )
    return hf


def attention(config) -> str:
    """sdpa where the architecture supports it (most); else transformers' eager attention,
    the same computation unfused (Gemma 2's logit soft-capping, Bloom's ALiBi)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"


def _transformers_config(transformers, hf_config: dict[str, Any]):
    model_type = hf_config["model_type"]
    if model_type not in transformers_causal_lm_types():
        raise CheckpointError(
            f"config.json describes a '{model_type}' model, which transformers "
            f"{transformers.__version__} does not build as a causal LM; freetx reads these "
            "natively or through transformers: see docs/models.md."
        )
    return transformers.AutoConfig.for_model(**hf_config)


class ConvertedNames:
    """transformers' conversion rules of one model type (`get_model_conversion_mapping`,
    what its `from_pretrained` applies), as freetx reads a folder tensor by tensor: a
    stored name -> the model's name and its place in it, and back for an export.

    A renaming (`WeightRenaming`, `PrefixChange`) renames; a `WeightConverter` that stacks
    the experts' tensors (`MergeModulelist(0)`, then `Concatenate(1)` where several stored
    tensors make one expert's row: its gate and up projections) gives the stored tensor's
    place: (row e, part p) of the fused tensor. Any other rule is refused by name, before
    a weight is read. An export writes the stored names back: the converters reversed,
    then the renamings; a `PrefixChange` (a multimodal folder's `model.language_model.`)
    only for a multimodal config (`multimodal`: its text model's tensors carry the prefix
    there, as transformers' `save_pretrained` writes them back after loading such a
    folder; a text model's folder never had it)."""

    def __init__(self, rules: list, model_type: str, multimodal: bool = False) -> None:
        self.renamings, self.converters = [], []
        for rule in rules:
            kind = type(rule).__name__
            if kind in ("WeightRenaming", "PrefixChange"):
                self.renamings.append(rule)
            elif kind == "WeightConverter" and _streamable(rule):
                self.converters.append(rule)
            else:
                operations = ", ".join(repr(op) for op in getattr(rule, "operations", ()))
                raise CheckpointError(
                    f"transformers converts '{model_type}' folders on load with {kind}"
                    f"({rule.source_patterns} -> {rule.target_patterns}"
                    f"{', ' + operations if operations else ''}), which freetx does not "
                    "read as it streams a folder (it reads renamings and experts stacked "
                    "per expert, with their gate and up projections joined). No native "
                    f"freetx layout reads '{model_type}' yet: see docs/models.md for the "
                    "model types freetx trains."
                )
        # an export's: the converters reversed, then the renamings (PrefixChange left out)
        self.back = [(rule, rule.reverse_transform()) for rule in self.converters]
        self.renamed_back = [
            rule.reverse_transform()
            for rule in reversed(self.renamings)
            if multimodal or type(rule).__name__ != "PrefixChange"
        ]

    def place(self, stored: str) -> tuple[str, int | tuple[int, int] | None]:
        """The model's name of a stored tensor, and its place there: None (the whole
        tensor), row e of a stacked one, or (e, p): part p of row e (`HFLayout.stack_index`)."""
        name = stored
        for rule in self.renamings:
            name, _ = rule.rename_source_key(name)
        for rule in self.converters:
            fused, pattern = rule.rename_source_key(name)
            if pattern is not None:
                row = int(re.search(_row_pattern(pattern), name).group(1))
                part = rule.source_patterns.index(pattern)
                return fused, (row if len(rule.source_patterns) == 1 else (row, part))
        return name, None

    def stored_names(self, name: str, rows: int) -> list[str]:
        """The stored names of model tensor `name` (`rows`: its first dimension), row by
        row and each row's parts in order."""
        for rule, reverse in self.back:
            renamed, pattern = reverse.rename_source_key(name)
            if pattern is not None:
                before, _, after = renamed.partition(rule.source_patterns[0])
                names = [
                    before + source.replace("*", str(row)) + after
                    for row in range(rows)
                    for source in rule.source_patterns
                ]
                return [self._renamed_back(n) for n in names]
        return [self._renamed_back(name)]

    def _renamed_back(self, name: str) -> str:
        for rule in self.renamed_back:
            name, _ = rule.rename_source_key(name)
        return name


def _streamable(rule) -> bool:
    """A converter that stacks experts (`MergeModulelist(0)`; with several sources, each
    expert's joined along its rows: `Concatenate(1)`), its patterns plain names with one
    `*` (the expert's number)."""
    kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
    sources = rule.source_patterns
    plain = all(p.count("*") == 1 and re.fullmatch(r"[\w.*]+", p) for p in sources) and all(
        re.fullmatch(r"[\w.]+", p) for p in rule.target_patterns
    )
    if len(sources) == 1:
        return plain and kinds == [("MergeModulelist", 0)]
    return plain and kinds == [("MergeModulelist", 0), ("Concatenate", 1)]


def _row_pattern(source_pattern: str) -> str:
    return re.escape(source_pattern).replace(r"\*", r"(\d+)")


# each model type's rules, read once (they depend on its classes, not on its sizes)
_CONVERSIONS: dict[str, ConvertedNames] = {}


def converted_names(hf: nn.Module, hf_config: dict[str, Any]) -> ConvertedNames:
    """The conversion rules of transformers model `hf` (built on any device) of config.json
    `hf_config`, or an error naming one freetx does not read."""
    model_type = hf_config["model_type"]
    if model_type not in _CONVERSIONS:
        from transformers.conversion_mapping import get_model_conversion_mapping

        rules = get_model_conversion_mapping(hf, add_legacy=False)
        multimodal = "text_config" in hf_config
        _CONVERSIONS[model_type] = ConvertedNames(rules, model_type, multimodal)
    return _CONVERSIONS[model_type]


class HFGenericLayout:
    """The generic model's HF layout: the folder's tensor names as transformers stores
    them (`ConvertedNames`: its conversion rules, where the type has any), and config.json
    written back from the recorded dict. It reads every model_type transformers builds
    as a causal LM (`freetx.models.hf.LAYOUTS` asks the native layouts first); bound to
    one (`for_config`), it names that type's stored tensors."""

    model_class = "freetx.models.hf_generic.HFGenericModel"

    def __init__(
        self, names: ConvertedNames | None = None, keys: frozenset[str] | None = None
    ) -> None:
        self.names = names
        self.keys = keys  # the model's tensors (bound): a stored tensor of none is skipped

    def for_config(self, hf: dict[str, Any]) -> HFGenericLayout:
        """This layout for a config.json: its model type's rules and its model's tensors
        (read on the meta device, once per config)."""
        return _bound_layout(json.dumps(hf, sort_keys=True))

    @property
    def model_types(self) -> tuple[str, ...]:
        return transformers_causal_lm_types()

    def to_hf_name(self, name: str) -> str:
        return name if self.names is None else self.names.stored_names(name, 1)[0]

    def from_hf_name(self, name: str) -> str | None:
        """The model's name of a stored tensor; None for one that is no tensor of the model
        (a multimodal folder's vision tower, which transformers' causal LM leaves too)."""
        if name.endswith(_NOT_WEIGHTS):
            return None
        name = name if self.names is None else self.names.place(name)[0]
        return None if self.keys is not None and name not in self.keys else name

    def to_hf_names(self, name: str, rows: int, model_config: dict[str, Any]) -> list[str]:
        return self.for_config(model_config["hf_config"]).names.stored_names(name, rows)

    def stack_index(self, name: str) -> int | tuple[int, int] | None:
        return None if self.names is None else self.names.place(name)[1]

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]:
        return {**model_config["hf_config"], "dtype": dtype}

    def from_hf_config(self, hf: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
        """The generic model's config; what it cannot read is refused here, before a
        conversion writes anything (the model is built on the meta device to ask)."""
        with torch.device("meta"):
            build_hf(hf)
        return {"hf_config": hf, "max_seq_len": max_seq_len}


GENERIC_LAYOUT = HFGenericLayout()


@lru_cache(maxsize=16)
def _bound_layout(hf_json: str) -> HFGenericLayout:
    hf_config = json.loads(hf_json)
    with torch.device("meta"):
        keys = frozenset(build_hf(hf_config).state_dict())
    return HFGenericLayout(_CONVERSIONS[hf_config["model_type"]], keys)


def _is_norm(module: nn.Module) -> bool:
    """transformers' norms are its own classes per model (LlamaRMSNorm, ...): by name."""
    name = type(module).__name__
    return (
        isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "LayerNorm" in name or "RMSNorm" in name
    )


@contextmanager
def _parameters_kept(model: nn.Module):
    """transformers' initializers leave tensors marked `_is_hf_initialized` alone: mark every
    parameter, so that its `_init_weights` computes buffers only."""
    params = list(model.parameters())
    for p in params:
        p._is_hf_initialized = True
    try:
        yield
    finally:
        for p in params:
            del p._is_hf_initialized


class HFCache(CachedRows):
    """transformers' KV cache for a batch of rows (`hf`), and the rows' padding."""

    def __init__(self, hf_cache: Any, max_len: int, left_padding: torch.Tensor) -> None:
        super().__init__(max_len, left_padding)
        self.hf = hf_cache

    def attention_mask(self, keys: int) -> torch.Tensor:
        """[B, keys] of ones, zeros on the padding keys (transformers' attention_mask)."""
        valid = self.key_valid(keys)
        if valid is None:
            return torch.ones(
                len(self.left_padding), keys, dtype=torch.long, device=self.ids.device
            )
        return valid.long()


def cache_argument(hf: nn.Module) -> str | None:
    """The name a transformers causal LM's forward takes its KV cache by: `cache`
    (transformers >= 5.2x), `past_key_values` (before), or None (a recurrent state)."""
    parameters = inspect.signature(hf.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


@lru_cache(maxsize=16)
def _cache_problem(hf_json: str) -> str | None:
    hf_config = json.loads(hf_json)
    transformers = require_transformers()
    from transformers.cache_utils import CacheLayerMixin

    with torch.device("meta"):
        hf = build_hf(hf_config)
    name, argument = type(hf).__name__, cache_argument(hf)
    if argument is None:
        return (
            f"transformers' {name} takes no KV cache freetx can pass (it keeps a state of its "
            "own). Generate with a full forward per token: kv_cache=false."
        )
    config = hf.config.get_text_config(decoder=True)
    cache = transformers.DynamicCache(config=config)
    if any(isinstance(layer, CacheLayerMixin) for layer in cache.layers):
        return None  # an attention layer keeps the cached length
    try:  # every layer recurrent: does the forward ask the cache for its length?
        with torch.device("meta"):
            hf(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, **{argument: cache})
    except ValueError as e:
        if "get_seq_length" not in str(e):
            return None
        kinds = sorted(set(getattr(config, "layer_types", None) or ["linear_attention"]))
        return (
            f"transformers' {name} cannot generate from its cache: every layer of this "
            f"'{hf_config['model_type']}' model is {' or '.join(kinds)} (no attention layer), "
            "and its forward reads the cached length from an attention layer, so a cached "
            "step would fail. Generate with a full forward per token: kv_cache=false (or "
            "give config.json's layer_types a full_attention layer)."
        )
    except Exception:  # noqa: BLE001 - the meta device cannot run it all (routing): no verdict
        return None
    return None


def cache_problem(hf_config: dict[str, Any]) -> str | None:
    """Why transformers' own cache (`new_cache`) cannot serve the generation of a generic
    model of config.json `hf_config`, as a one-paragraph refusal with the fix, or None.
    Asked of the model built on the meta device (no weight read): a model that keeps a
    state of its own (no cache argument), or one whose every layer is linear attention or
    state-space (no attention layer) while its forward reads the cached length from an
    attention layer (Qwen3.5 with no full_attention layer; Mamba, which never asks, is
    served)."""
    return _cache_problem(json.dumps(hf_config, sort_keys=True))


def takes_positions(hf: nn.Module) -> bool:
    """Whether the forward takes position_ids (transformers' `generate` passes them where it
    does; ALiBi models count positions from the attention mask)."""
    return "position_ids" in inspect.signature(hf.forward).parameters


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class HFGenericModel(nn.Module):
    """A transformers causal LM as a freetx model: `forward(input_ids) -> logits`. The HF
    model (`self.hf`, not a registered submodule) and this one share its children, so
    every name is the HF model's; a child replaced here (LoRA on `lm_head`) is replaced
    there too."""

    config_class = HFGenericConfig
    hf_layout = GENERIC_LAYOUT

    def __init__(self, cfg: HFGenericConfig):
        super().__init__()
        self.config = cfg
        hf = build_hf(cfg.hf_config)
        object.__setattr__(self, "hf", hf)  # not a submodule: its children are ours
        for name, child in hf.named_children():
            self.add_module(name, child)
        split = set(getattr(self.hf, "_no_split_modules", None) or ())
        # per instance (the protocol allows it): the blocks depend on the architecture
        self.block_types = tuple({type(m) for m in self.hf.modules() if type(m).__name__ in split})
        # tied weights (lm_head = the embedding) are one parameter; checkpoints hold it once
        self.tied: dict[str, str] = {}  # tied name (lm_head.weight) -> the parameter it is
        first: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            self.tied.update({name: first[id(param)]} if id(param) in first else {})
            first.setdefault(id(param), name)
        self.register_state_dict_post_hook(_drop_tied)
        self.register_load_state_dict_post_hook(_tied_not_missing)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        hf = self.__dict__.get("hf")
        if hf is not None and isinstance(value, nn.Module) and name in hf._modules:
            hf._modules[name] = value

    def train(self, mode: bool = True) -> HFGenericModel:
        self.hf.training = mode
        return super().train(mode)

    def to_empty(self, *, device, recurse: bool = True) -> HFGenericModel:
        """As nn.Module's, with tied weights tied again (it gives each module its own)."""
        super().to_empty(device=device, recurse=recurse)
        for name, source in self.tied.items():
            owner, _, attr = name.rpartition(".")
            setattr(self.get_submodule(owner), attr, self.get_parameter(source))
        return self

    def describe(self) -> str:
        name = f"generic transformers path for {self.config.hf_config['model_type']}"
        kind = self.hf.config._attn_implementation
        return name if kind == "sdpa" else f"{name} ({kind} attention)"

    def new_cache(self, left_padding: torch.Tensor, max_len: int) -> HFCache:
        """transformers' DynamicCache for len(left_padding) rows (`DecodesIncrementally`),
        or the refusal of `cache_problem`."""
        transformers = require_transformers()
        problem = cache_problem(self.config.hf_config)
        if problem is not None:
            raise ConfigError(problem)
        config = self.hf.config.get_text_config(decoder=True)
        return HFCache(transformers.DynamicCache(config=config), max_len, left_padding)

    def output_layer(self) -> OutputLayer:
        """transformers' forward computes the logits whole (its own head and any scaling
        or soft-cap after it), so they are handed to a loss as they are
        (`ProjectsInChunks`): the identity, reading no parameter."""
        vocab_size = self.hf.config.get_text_config(decoder=True).vocab_size
        return OutputLayer(_identity, (), vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HFCache | None = None,
        output_loss: OutputLoss | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab_size]. With a `cache` (`new_cache`),
        input_ids are the tokens after the cached ones, and the cache holds them after.
        `output_loss`: what it makes of the logits (`output_layer`) in their place."""
        if cache is None:
            logits = self.hf(input_ids=input_ids, use_cache=False).logits
            return logits if output_loss is None else output_loss(logits, self.output_layer())
        new = input_ids.shape[1]
        positions = {"position_ids": cache.positions(new)} if takes_positions(self.hf) else {}
        # the step's inputs as transformers' `generate` makes them: each model's own rules
        # (Mamba reads the mask on the prompt alone; a mask on later steps changes its state)
        inputs = self.hf.prepare_inputs_for_generation(
            input_ids,
            attention_mask=cache.attention_mask(cache.length + new),
            use_cache=True,
            is_first_iteration=cache.length == 0,
            **{cache_argument(self.hf): cache.hf},
            **positions,
        )
        logits = self.hf(**inputs).logits
        cache.advance(input_ids)
        return logits

    # -- initialization ---------------------------------------------------
    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """By the owning module's type: Linear, Embedding and transformers' Conv1D (GPT-2)
        weights ~ N(0, initializer_range) (an embedding's padding row zero), and so an MoE
        block's experts (`Qwen3MoeExperts`' [E, 2I, H] `gate_up_proj`) and router weights, as
        each model's `_init_weights` starts them; norms one, biases zero; anything else is
        refused."""
        module_name, _, param_name = name.rpartition(".")
        module = self.get_submodule(module_name)
        moe = type(module).__name__.endswith(("Experts", "Router"))
        if param_name == "bias" or (moe and param_name.endswith("bias")):
            tensor.zero_()
        elif _is_norm(module):
            tensor.fill_(1.0)
        elif (
            isinstance(module, (nn.Linear, nn.Embedding))
            or type(module).__name__ == "Conv1D"
            or moe
        ):
            std = float(self.config.hf_config.get("initializer_range", 0.02))
            init_normal(module, tensor, std, generator)
        else:
            raise CheckpointError(
                f"freetx cannot initialize {name} ({type(module).__name__}) of a generic "
                "transformers model randomly; start from the folder's weights "
                "(checkpoint.initial_weights=<the folder>)."
            )

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE's inv_freq, Gemma's embedding scale) on
        their device, as transformers' own `_init_weights` does, parameters untouched."""
        with _parameters_kept(self.hf):
            for module in self.hf.modules():
                if next(module.buffers(recurse=False), None) is not None:
                    self.hf._init_weights(module)

    # -- accounting -------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.hf.get_input_embeddings().weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """6 N (non-embedding) + 12 L H T for attention (H = hidden size)."""
        text = self.hf.config.get_text_config()
        attention = 12 * text.num_hidden_layers * text.hidden_size * seq_len
        return float(6 * self.num_parameters(exclude_embeddings=True) + attention)

    def activation_bytes(self, run: TrainingShape) -> ActivationBytes:
        """Counted as a dense decoder of its width (every key and value head its own)."""
        c = self.config
        kv = c.num_heads * (c.hidden_dim // c.num_heads)
        return decoder_activations(run, c.hidden_dim, c.ffn_hidden_dim, kv, c.vocab_size)


def _drop_tied(module: HFGenericModel, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in module.tied:
        state_dict.pop(prefix + name, None)


def _tied_not_missing(module: HFGenericModel, incompatible) -> None:
    for name in module.tied:
        if name in incompatible.missing_keys:
            incompatible.missing_keys.remove(name)
