"""Issue 36's audit: what a run refused at once (after starting its processes), and values it
took to mean something else, are refused by `freetx validate` with the run's own paragraph
(one check, called by both, and by `freetx run` before it launches anything)."""

import pytest

from freetx.distributed import Processes
from freetx.distributed.mesh import MeshShape
from freetx.errors import ConfigError
from tests.conftest import flat, run_freetx_here


@pytest.fixture(scope="module")
def generic_folder(tmp_path_factory):
    """A tiny GPT-2 folder: read through the generic transformers path."""
    from tests.hf_folders import make_folder

    return make_folder(tmp_path_factory.mktemp("gpt2") / "gpt2", "gpt2")


REFUSED = {
    # case id: (config, overrides, words of the refusal)
    "tp_not_dividing_the_heads": (
        "llm/tiny_tp", ["distributed.tp=4", "--world-size", "4"],
        "tp=4 does not divide the model's 6 attention heads and 2 key/value heads",
    ),
    "more_pipeline_stages_than_blocks": (
        "llm/tiny_pp", ["distributed.pp=8", "gradient_accumulation_steps=8", "--world-size", "8"],
        "makes 8 pipeline stages, and the model has 4 blocks",
    ),
    "pp_blocks_per_stage_not_summing_to_the_blocks": (
        "llm/tiny_pp", ["distributed.pp_blocks_per_stage=[1,1]", "--world-size", "4"],
        "pp_blocks_per_stage=[1, 1] gives 2 blocks, and the model has 4",
    ),
    "dora_with_tp": (
        "llm/dora_tiny", ["distributed.tp=2", "--world-size", "2"],
        "DoRA's magnitudes divide by the norm of each whole weight row",
    ),
    "mixture_weight_of_0": (
        "llm/mixture_tiny", ["dataset.weights=[3,0]"],
        "'dataset.weights' is [3, 0]: weights[1] is 0; a weight is a positive number",
    ),
    "negative_lr": ("llm/tiny", ["optimizer.lr=-1"], "'optimizer.lr' is -1: a learning rate"),
    "nan_lr": ("llm/tiny", ["optimizer.lr=nan"], "'optimizer.lr' is 'nan': a learning rate"),
    "seq_len_0": ("llm/tiny", ["dataset.seq_len=0"], "'dataset.seq_len' is 0"),
    "seq_len_0_in_a_mixture_source": (
        "llm/mixture_tiny", ["dataset.sources.0.seq_len=0"], "'dataset.sources[0].seq_len' is 0"
    ),
    "val_fraction_1_5": (
        "llm/tiny", ["dataset.val_fraction=1.5"], "'dataset.val_fraction' is 1.5: it is the share"
    ),
    "num_layers_0": ("llm/tiny", ["model.num_layers=0"], "'model.num_layers' is 0"),
    "hidden_dim_negative": ("llm/tiny", ["model.hidden_dim=-5"], "'model.hidden_dim' is -5"),
    "loss_num_chunks_0": ("llm/tiny", ["loss.num_chunks=0"], "'loss.num_chunks' is 0"),
    "latent_dim_0": ("free_transformer/tiny", ["model.latent_dim=0"], "'model.latent_dim' is 0"),
    "split_layer_beyond_the_blocks": (
        "free_transformer/tiny", ["model.split_layer=10"],
        "'model.split_layer' is 10: the latent joins after split_layer of the num_layers=4",
    ),
    "collective_timeout_0": (
        "llm/tiny", ["distributed.collective_timeout_s=0"],
        "'distributed.collective_timeout_s' is 0: it is how long a collective may wait",
    ),
    "max_grad_norm_negative": (
        "llm/tiny", ["max_grad_norm=-1"], "'max_grad_norm' is -1: gradients are clipped to a "
        "positive norm; set one (e.g. 1.0), or max_grad_norm=null for no clipping",
    ),
    "max_grad_norm_0": ("llm/tiny", ["max_grad_norm=0"], "max_grad_norm=null for no clipping"),
    "min_lr_ratio_5": (
        "llm/tiny", ["lr_schedule.min_lr_ratio=5"], "'lr_schedule.min_lr_ratio' is 5: the lr "
        "decays to min_lr_ratio x lr, so a ratio above 1 raises it",
    ),
    "negative_peak_flops": ("llm/tiny", ["peak_flops=-5"], "'peak_flops' is -5"),
    "ad_grid_size_smaller_than_num_states": (
        "ad/darkroom_tiny", ["model.grid_size=5"],
        "5x5 = 25 cells hold fewer than model.num_states=81; set model.grid_size=9",
    ),
    "lora_recipe_without_peft": (
        "llm/tiny", ["--recipe", "lora_finetune_fsdp2"],
        "recipe lora_finetune_fsdp2 trains adapters, and this config sets no peft.method "
        "(no `peft:` section), so it would fine-tune every weight without a word. Add "
        "peft.method=lora",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_validate_refuses_what_the_run_refuses(case):
    config, overrides, words = REFUSED[case]
    result = run_freetx_here("validate", config, *overrides)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert words in flat(result.stdout), result.stdout


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_parallelism_on_the_generic_path_is_refused_by_validate(generic_folder, axis):
    result = run_freetx_here(
        "validate", "llm/hf_tiny_full", f"model_dir={generic_folder}", f"distributed.{axis}=2",
        "gradient_accumulation_steps=2", "--world-size", "2",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "HFGenericModel" in result.stdout and f"distributed.{axis} > 1 cannot run it" in flat(
        result.stdout
    )


@pytest.mark.parametrize(
    "config, recipe, owner",
    [("ad/darkroom_tiny", "full_finetune_fsdp2", "ad_ddp"),
     ("crosscoder/synthetic_tiny", "full_finetune_fsdp2", "crosscoder_fsdp2"),
     ("llm/tiny", "generate", "full_finetune_fsdp2")],
    ids=["darkroom_to_full_finetune", "crosscoder_to_full_finetune", "llm_tiny_to_generate"],
)  # fmt: skip
def test_a_config_of_another_recipe_names_its_recipe(config, recipe, owner):
    result = run_freetx_here("validate", config, "--recipe", recipe)
    assert result.returncode == 1
    assert (
        f"{config} is a config of recipe {owner}, not {recipe}: run it with "
        f"`freetx run {owner} --config {config}`."
    ) in flat(result.stdout)


def test_a_config_file_of_another_recipe_names_the_recipe_it_looks_like(tmp_path):
    from freetx import registry

    path = tmp_path / "mine.yaml"
    path.write_text(registry.config_file("ad/darkroom_tiny").read_text())
    result = run_freetx_here("validate", str(path), "--recipe", "full_finetune_fsdp2")
    assert f"{path} looks like a config of recipe ad_ddp" in flat(result.stdout)


def test_the_right_recipe_gets_no_hint_and_shipped_lora_configs_pass(tmp_path):
    for config in ("llm/tiny", "llm/lora_tiny", "llm/spectrum_tiny"):
        result = run_freetx_here("validate", config, f"model_dir={tmp_path}")
        assert result.returncode == 0, result.stdout


def test_validate_refuses_a_model_dir_that_does_not_exist(tmp_path):
    result = run_freetx_here("validate", "llm/lora_tiny", f"model_dir={tmp_path / 'nope'}")
    assert result.returncode == 1
    assert f"model_dir={tmp_path / 'nope'} does not exist. Point model_dir at" in flat(
        result.stdout
    )


def test_run_refuses_a_model_dir_that_does_not_exist_before_starting_ranks(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        launch("--nproc-per-node", "2", "lora_finetune_fsdp2", "--config", "llm/lora_tiny",
               f"model_dir={tmp_path / 'nope'}", f"output_dir={tmp_path / 'run'}")  # fmt: skip


@pytest.mark.parametrize(
    "config, key", [("llm/instruct_tiny", "dataset.source"),
                    ("llm/mixture_tiny", "dataset.sources.0.source")],
    ids=["data_file", "data_file_of_a_mixture_source"],
)  # fmt: skip
def test_validate_refuses_a_data_file_that_does_not_exist(tmp_path, config, key):
    missing = tmp_path / "pairs.jsonl"
    result = run_freetx_here("validate", config, f"{key}={missing}")
    assert result.returncode == 1
    assert f"data file {missing} does not exist; fix dataset.source" in flat(result.stdout)
    missing.write_text('{"prompt": "a", "response": "b"}\n')
    assert run_freetx_here("validate", config, f"{key}={missing}").returncode == 0


def test_tp_on_one_node_of_3_processes_says_3_is_not_divisible_by_tp():
    from freetx.distributed.config import DistributedConfig

    with pytest.raises(ConfigError) as e:
        MeshShape.of(DistributedConfig(tp=2), Processes(3, 3, "cpu"))
    message = flat(str(e.value))
    assert "span nodes" not in message
    assert "does not divide the 3 process(es) of this run" in message


def test_tp_that_does_not_divide_a_node_still_says_the_group_would_span_nodes():
    from freetx.distributed.config import DistributedConfig

    with pytest.raises(ConfigError, match="a tp group would span nodes"):
        MeshShape.of(DistributedConfig(tp=2), Processes(6, 3, "cpu"))


def launch(*argv: str) -> None:
    """`freetx run ARGV` in this process, for a refusal made before anything is launched."""
    from freetx.cli.run import main

    main(list(argv))


def test_run_refuses_device_cuda_on_a_machine_without_one_before_starting_ranks(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device: cuda was asked for, but this machine has no"):
        launch("--nproc-per-node", "8", "full_finetune_fsdp2", "--config", "llm/tiny",
               "device=cuda", f"output_dir={tmp_path}")  # fmt: skip


@pytest.mark.parametrize(
    "override, words",
    [("model.num_layers=0", "'model.num_layers' is 0"),
     ("distributed.pp_blocks_per_stage=[1,1]", "pp_blocks_per_stage=[1, 1] gives 2 blocks")],
    ids=["num_layers_0", "pp_blocks_per_stage_not_summing"],
)  # fmt: skip
def test_run_refuses_before_starting_ranks(tmp_path, override, words):
    config = "llm/tiny_pp" if "pp_" in override else "llm/tiny"
    with pytest.raises(ConfigError) as e:
        launch("--nproc-per-node", "4", "full_finetune_fsdp2", "--config", config, override,
               f"output_dir={tmp_path}")  # fmt: skip
    assert words in flat(str(e.value))


def test_lora_recipe_run_without_peft_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="peft.method=lora"):
        launch("lora_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}")


def test_doctor_refuses_a_timeout_too_small_for_the_processes_to_start():
    result = run_freetx_here("doctor", "--timeout-s", "0.001")
    assert result.returncode == 2
    assert "--timeout-s: 0.001 is less than 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_spectrum_top_percent_0_001_says_the_real_share_it_selected():
    from freetx.models.peft.spectrum import select, selected_share, selection_text

    scores = {f"layers.{i}.attention.{m}": float(i) for i in range(4) for m in ("wq", "wk")}
    modules = select(scores, 0.001)
    assert modules == ["layers.3.attention.wk", "layers.3.attention.wq"]
    said = selected_share(modules, scores, 0.001)
    assert said.startswith("2 of 8 weight matrices selected (25%: --top-percent 0.001 keeps")
    assert "at least one of each kind" in said
    assert f"# {said}" in selection_text(modules, 0.001, "m", scores)
    assert selected_share(select(scores, 50), scores, 50).endswith(
        "(50%: the top 50% of each kind)"
    )


def test_vocab_size_10_12_in_config_json_is_refused_before_allocating(generic_folder, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(generic_folder, tmp_path / "big")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 10**12}))
    result = run_freetx_here("validate", "llm/hf_tiny_full", f"model_dir={folder}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{folder / 'config.json'} gives vocab_size=1000000000000, past any model's" in flat(
        result.stderr
    )
    assert "Fix vocab_size in config.json" in flat(result.stderr)
