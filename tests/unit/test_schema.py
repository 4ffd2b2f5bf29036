"""Schema checks: typos with suggestions, types, Literal choices, required keys."""

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError

from freetx.config import apply_schema, check_config
from freetx.errors import ConfigError


@dataclass
class Section:
    every_n_steps: int = 100
    keep_last: Optional[int] = None


@dataclass
class Schema:
    output_dir: str = MISSING
    max_steps: int = 10
    lr: float = 1e-3
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    tags: list[str] = field(default_factory=list)
    checkpoint: Section = field(default_factory=Section)
    optimizer: Any = None


def problems_of(**values):
    return check_config(OmegaConf.create({"output_dir": "x", **values}), Schema)


def test_clean_config_has_no_problems():
    assert problems_of(max_steps=3, lr=1, tags=["a"], checkpoint={"keep_last": 2}) == []


def test_misspelt_key_suggests_the_valid_one():
    (problem,) = problems_of(max_stpes=10)
    assert "max_stpes" in problem and "did you mean 'max_steps'" in problem


def test_misspelt_nested_key_suggests_with_path():
    (problem,) = problems_of(checkpoint={"evry_n_steps": 5})
    assert "checkpoint.evry_n_steps" in problem and "'checkpoint.every_n_steps'" in problem


def test_key_at_the_wrong_level_points_to_its_section():
    (problem,) = problems_of(keep_last=3)
    assert "did you mean 'checkpoint.keep_last'" in problem


@pytest.mark.parametrize(
    "values,fragment",
    [
        ({"max_steps": "ten"}, "'max_steps' must be int"),
        ({"max_steps": 1.5}, "'max_steps' must be int"),
        ({"lr": "fast"}, "'lr' must be float"),
        ({"strategy": "fsdpp"}, "'strategy' must be one of 'fsdp', 'ddp'"),
        ({"tags": "a"}, "'tags' must be a list"),
        ({"checkpoint": {"keep_last": "all"}}, "'checkpoint.keep_last' must be int or null"),
    ],
)
def test_wrong_types(values, fragment):
    (problem,) = problems_of(**values)
    assert fragment in problem


def test_missing_required_key():
    problems = check_config(OmegaConf.create({}), Schema)
    assert problems == ["missing required key 'output_dir' (str)."]


def test_all_problems_at_once():
    problems = problems_of(max_stpes=1, lr="x", strategy="y", optimizer={"_component_": "nope.x"})
    assert len(problems) == 4


def test_apply_schema_fills_defaults_and_is_strict():
    cfg = apply_schema(OmegaConf.create({"output_dir": "x", "lr": 1}), Schema)
    assert cfg.max_steps == 10 and cfg.checkpoint.every_n_steps == 100
    assert isinstance(cfg.lr, float)
    with pytest.raises(ConfigAttributeError):
        _ = cfg.not_a_key


def test_config_error_lists_every_problem():
    err = ConfigError(["one", "two"], fix="Fix them.")
    assert "2 problems" in str(err) and "  - one" in str(err) and str(err).endswith("Fix them.")


@pytest.mark.parametrize(
    ("options", "world", "wanted", "fix"),
    [
        ({"tp": 3}, 4, "distributed.tp=3 needs 3 processes per data-parallel rank", "tp=1"),  # one node
        ({"tp": 2, "strategy": "ddp"}, 4, "distributed.tp=2 composes with fsdp, zero2 or hsdp",
         "tp=1"),
        ({"tp": 2, "strategy": "hsdp", "replicate_degree": 4}, 12,
         "does not divide the 6 data-parallel ranks (2 processes each)", "replicate_degree"),
        ({"tp": 8}, 16, "a tp group would span nodes", "tp=1"),  # 4 processes per node
        ({"cp": 3}, 4, "distributed.cp=3 needs 3 processes per data-parallel rank", "cp=1"),
        ({"cp": 2, "strategy": "zero1"}, 4, "distributed.cp=2 composes with fsdp", "cp=1"),
        ({"cp": 2, "tp": 4}, 4, "distributed.cp=2 and distributed.tp=4 need 8 processes",
         "cp=1 and tp=1"),
        ({"pp": 3}, 4, "distributed.pp=3 needs 3 processes per data-parallel rank", "pp=1"),
        ({"pp": 2, "strategy": "ddp"}, 4, "distributed.pp=2 composes with fsdp", "pp=1"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, 4, "pp_stages_per_rank is 1",
         "pp_stages_per_rank=2"),
        ({"pp": 2, "pp_stages_per_rank": 2}, 4, "runs one stage per rank",
         "pp_schedule=interleaved_1f1b"),
        ({"pp": 2, "pp_blocks_per_stage": [1, 2, 1]}, 4, "lists 3 stage(s), and pp=2",
         "Give 2 block counts"),
        ({"async_tp": True, "compile": True}, 4, "distributed.tp=1 has none", "async_tp=false"),
        ({"async_tp": True, "tp": 2}, 4, "distributed.compile is false", "async_tp=false"),
        ({"async_tp": True, "tp": 2, "compile": True}, 4, "this run is on the CPU",
         "async_tp=false"),
    ],
)  # fmt: skip
def test_impossible_mesh_layouts_are_refused_with_the_fix(options, world, wanted, fix):
    from freetx.distributed import DistributedConfig, Processes, check_distributed
    from freetx.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        check_distributed(DistributedConfig(**options), Processes(world, min(world, 4), "cpu"))
    assert wanted in str(error.value) and fix in str(error.value)


@pytest.mark.parametrize(
    ("fields", "wanted"),
    [
        ({"num_heads": 6, "num_kv_heads": 3}, "does not divide the model's 6 attention heads"),
        ({"ffn_hidden_dim": 45}, "does not divide the MLP's 45 hidden units"),
        ({"fused_projections": True}, "fused q/k/v"),
    ],
)
def test_a_decoder_refuses_a_tp_it_cannot_slice(fields, wanted):
    import torch

    from freetx.errors import ConfigError
    from freetx.models.transformer import decoder

    base = dict(vocab_size=64, hidden_dim=24, num_layers=1, num_heads=4, num_kv_heads=2,
                ffn_hidden_dim=48, max_seq_len=16)  # fmt: skip
    with torch.device("meta"):
        model = decoder(**{**base, **fields})
    with pytest.raises(ConfigError, match="tp=1") as error:
        model.tensor_parallel_plan(2)
    assert wanted in str(error.value)
    with torch.device("meta"):
        plan = decoder(**base).tensor_parallel_plan(2)
    assert plan["layers.0.attention.wq"] == "colwise" and plan["layers.0.attention.wo"] == "rowwise"
    assert plan["tok_embeddings"] == "embedding" and plan["output"] == "output"


@pytest.mark.parametrize(
    "targets,options,wanted",
    [(["q", "v"], {"use_dora": True}, "DoRA's magnitudes divide by the norm"),
     (["q", "output"], {}, "not on a output layer")],
)  # fmt: skip
def test_tensor_parallelism_slices_lora_and_refuses_what_it_cannot(targets, options, wanted):
    """LoRA slices with its base (A whole and B's rows under a colwise base, A's columns
    and B whole under a rowwise one: tests/distributed/test_mesh_layouts.py trains it);
    DoRA (whole-row norms) and an adapter on the head are refused with the fix."""
    import torch
    from torch.distributed.tensor import DTensor

    from freetx.distributed import MeshShape, fake_world
    from freetx.distributed.tensor_parallel import apply_tensor_parallel
    from freetx.errors import ConfigError
    from freetx.models.peft import apply_lora
    from freetx.models.transformer import decoder

    fields = dict(vocab_size=64, hidden_dim=24, num_layers=1, num_heads=4, num_kv_heads=2,
                  ffn_hidden_dim=48, max_seq_len=16, tie_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        lora, refused = decoder(**fields), decoder(**fields)
        apply_lora(lora, ["q", "o"], rank=2, alpha=4)
        apply_lora(refused, targets, rank=2, alpha=4, **options)
    with fake_world(4):
        tp_mesh = MeshShape("fsdp", dp_shard=2, tp=2).build("cpu")["tp"]
        apply_tensor_parallel(lora, tp_mesh)
        with pytest.raises(ConfigError, match="tp=1") as error:
            apply_tensor_parallel(refused, tp_mesh)
    assert wanted in str(error.value)
    q, o = lora.layers[0].attention.wq, lora.layers[0].attention.wo
    assert all(isinstance(p, DTensor) for p in (q.weight, q.lora_a.weight, o.lora_b.weight))
    assert q.lora_b.weight.to_local().shape == (12, 2) and q.lora_a.weight.to_local().shape == (
        2,
        24,
    )
    assert o.lora_a.weight.to_local().shape == (2, 12) and o.lora_b.weight.to_local().shape == (
        24,
        2,
    )


def test_sequence_parallelism_slices_the_residual_stream_between_the_sliced_layers():
    """With sequence parallelism the plan gathers the stream before attention and the MLP,
    scatters it after (rowwise_sequence), slices its norms, and gathers it for the loss;
    a tied embedding's output is sliced by sequence, an untied one is reduce-scattered."""
    import torch

    from freetx.models.transformer import decoder

    fields = dict(vocab_size=64, hidden_dim=24, num_layers=1, num_heads=4, num_kv_heads=2,
                  ffn_hidden_dim=48, max_seq_len=16)  # fmt: skip
    with torch.device("meta"):
        tied, untied = (
            decoder(**fields, tie_embeddings=True),
            decoder(**fields, tie_embeddings=False),
        )
    plan = tied.tensor_parallel_plan(2, sequence_parallel=True)
    assert plan["layers.0.attention"] == plan["layers.0.feed_forward"] == "gather_sequence"
    assert plan["layers.0.attention.wo"] == plan["layers.0.feed_forward.w2"] == "rowwise_sequence"
    assert plan["layers.0.attention_norm"] == plan["layers.0.ffn_norm"] == "sequence_norm"
    assert "layers.0.post_attention_norm" not in plan  # Llama's: an identity
    assert plan["tok_embeddings"] == "split_sequence" and plan["norm"] == "gather_sequence"
    plan = untied.tensor_parallel_plan(2, sequence_parallel=True)
    assert plan["tok_embeddings"] == "embedding_sequence" and plan["output"] == "output"
