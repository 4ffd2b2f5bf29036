"""A config value that leaves its knob nothing to do (LoRA's alpha of 0: adapters that
never change the output; BatchTopK keeping every feature: no sparsity) is refused when
the config is validated: by `freetx validate` and by `freetx run` before it launches,
one line per value naming the key and the fix (freetx.fields.field_problems), and by
the config dataclass itself."""

from __future__ import annotations

import pytest

from freetx.models.crosscoder import CrosscoderConfig
from freetx.models.peft import PEFTConfig
from tests.conftest import flat, run_freetx_here, run_refused_here

LORA = "llm/lora_tiny"
CROSSCODER = "crosscoder/synthetic_tiny"  # dict_size 256
TOPK = ["model.activation=batchtopk", "model.k=8"]


@pytest.mark.parametrize(
    "config,overrides,message",
    [(LORA, ["peft.alpha=0"], "'peft.alpha' is 0: LoRA scales each update by alpha / rank"),
     (LORA, ["peft.alpha=-16"], "set it above 0"),
     (LORA, ["peft.dropout=1.0"], "'peft.dropout' is 1.0: it is the probability"),
     (LORA, ["peft.dropout=-0.1"], "set it in [0, 1)"),
     (LORA, ["peft.target_modules=[]"], "'peft.target_modules' is []: LoRA adapts"),
     (LORA, ["peft.method=none", "peft.use_dora=true"], "'peft.use_dora' is True: it applies to LoRA"),
     (LORA, ["peft.method=spectrum"], "make one with `freetx spectrum scan"),
     (CROSSCODER, ["model.activation=batchtopk", "model.k=256"],
      "'model.k' is 256: BatchTopK would keep every one of the 256 features (dict_size)"),
     (CROSSCODER, ["model.dict_size=16", *TOPK[:1]], "'model.k' is 32"),  # the default k
     (CROSSCODER, [*TOPK[:1], "model.k=0"], "'model.k' is 0: BatchTopK keeps k features"),
     (CROSSCODER, [*TOPK, "model.dead_after_rows=0"], "'model.dead_after_rows' is 0"),
     (CROSSCODER, [*TOPK, "model.threshold_beta=1.0"], "'model.threshold_beta' is 1.0"),
     (CROSSCODER, [*TOPK, "model.aux_k=0"], "'model.aux_k' is 0"),
     (CROSSCODER, ["model.activation=jumprelu", "model.tanh_c=0"], "'model.tanh_c' is 0"),
     (CROSSCODER, ["model.shared_features=300"], "set it in [0, 256]"),
     (CROSSCODER, ["model.dict_size=0"], "'model.dict_size' is 0"),
     ("llm/tiny", ["model.qk_norm=bogus"], "'model.qk_norm' is 'bogus': the decoder normalizes"),
     ("free_transformer/tiny", ["model.norm_position=mid"], "'model.norm_position' is 'mid'"),
     ("llm/tiny", ["model.num_experts=4", "model.experts_per_token=9"],
      "'model.experts_per_token' is 9: each token is sent to 1 to num_experts=4 experts"),
     ("llm/tiny", ["model.num_experts=4", "model.router_aux_loss_coef=-0.1"],
      "'model.router_aux_loss_coef' is -0.1: a negative weight"),
     ("free_transformer/tiny", ["model.num_experts=4"], "'model.num_experts' is 4"),
     ("llm/tiny", ["model.partial_rotary_factor=1.5"], "'model.partial_rotary_factor' is 1.5"),
     ("llm/tiny", ["model.activation=relu"], "'model.activation' is 'relu': the gated MLP"),
     ("llm/tiny", ["model.layer_types=[sliding_attention]", "model.sliding_window=8"],
      "'model.layer_types' is ['sliding_attention']: it names each of the num_layers=4"),
     ("llm/tiny", ["model.layer_types=[sliding_attention,full_attention,full_attention,"
                   "full_attention]"], "layer_types has sliding_attention layers but no window"),
     ("free_transformer/tiny", ["model.rope_local_theta=10000"], "layers share one RoPE"),
     ("ad/darkroom_tiny", ["model.scale_embeddings=true"],
      "'model.scale_embeddings' is True: AD's transformer does not compute it"),
     ("ad/darkroom_tiny", ["model.pad_token_id=0"], "'model.pad_token_id' is 0: AD's"),
     ("ad/darkroom_tiny", ["histories.planning_sweeps=0"],
      "'histories.knows_stay' is True: it shapes the planner's model of the room, and there "
      "is no planner (histories.planning_sweeps=0)"),
     ("ad/darkroom_tiny", ["histories.random_start=1.5"],
      "'histories.random_start' is 1.5: it is the share of the source's streams that start "
      "on a random cell, a probability; set it in [0, 1]"),
     ("ad/darkroom_tiny", ["histories.start_on_goal=-0.1"],
      "'histories.start_on_goal' is -0.1: it is the share of the source's streams that start "
      "on their goal, a probability; set it in [0, 1]"),
     ("llm/tiny", ["model.pad_token_id=259"], "'model.pad_token_id' is 259: it is the "
      "embedding row that gets no gradient (transformers' padding_idx); set an id below "
      "vocab_size=259, or null for none.")],
)  # fmt: skip
def test_validate_refuses_a_meaningless_value(config, overrides, message):
    result = run_freetx_here("validate", config, *overrides)
    assert result.returncode == 1, result.stdout
    assert message in flat(result.stdout), result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "config,overrides",
    [(LORA, ["peft.alpha=0.5", "peft.dropout=0.0"]),
     (LORA, ["peft.method=none", "peft.alpha=0", "--recipe", "full_finetune_fsdp2"]),  # no
     # adapters: alpha says nothing (lora_finetune_fsdp2 refuses no peft method)
     (CROSSCODER, [*TOPK, "model.dead_after_rows=1", "model.threshold_beta=0"]),
     (CROSSCODER, ["model.k=256"]),  # relu: k is not read
     ("llm/tiny", ["model.pad_token_id=258"]),
     ("llm/tiny", ["model.norm_position=sandwich", "model.norm_plus_one=true",
                   "model.activation=gelu_tanh", "model.sliding_window=32",
                   "model.attn_logit_softcap=50.0"])],
)  # fmt: skip
def test_values_that_still_mean_something_pass(config, overrides, tmp_path):
    base = [f"model_dir={tmp_path}"] if config == LORA else []  # its base: runs/llm_tiny
    result = run_freetx_here("validate", config, *base, *overrides)
    assert result.returncode == 0, result.stdout


def test_a_run_refuses_before_it_launches(tmp_path):
    result = run_refused_here(
        "--nproc-per-node", "2", "crosscoder_fsdp2", "--config", CROSSCODER,
        f"output_dir={tmp_path / 'run'}", "model.activation=batchtopk", "model.k=256",
    )  # fmt: skip
    assert result.returncode == 1 and "'model.k' is 256" in flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_the_config_dataclasses_refuse_them_too():
    with pytest.raises(ValueError, match="'k' is 64: BatchTopK would keep every one"):
        CrosscoderConfig(num_sources=2, source_dim=8, dict_size=64, activation="batchtopk", k=64)
    with pytest.raises(ValueError, match="'alpha' is 0"):
        PEFTConfig(method="lora", alpha=0)
    assert CrosscoderConfig(num_sources=2, source_dim=8, dict_size=64).aux_k == 4
