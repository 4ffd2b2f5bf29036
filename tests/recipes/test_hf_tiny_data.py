"""One data contract for the llm/hf_tiny_* configs: each reads the common files of its kind
(TRL's standard formats), the format found from the columns: chat and prompt/completion
files for full, lora and kd; prompt/chosen/rejected strings and chosen/rejected message
lists for dpo; prompt strings and conversations for grpo."""

from __future__ import annotations

import json

import pytest

from freetx.cli.common import load_recipe
from freetx.config import instantiate
from freetx.config.run_config import load_recipe_config
from freetx.data import checked_tokenizer
from freetx.registry import recipe_for_config


def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


ROWS = {
    "chat": [{"messages": [turn("user", f"say {i}"), turn("assistant", f"{i} said")]}
             for i in range(40)],
    "completion": [{"prompt": f"say {i}", "completion": f"{i} said"} for i in range(40)],
    "pairs": [{"prompt": f"say {i}", "chosen": f"{i} said", "rejected": "no"} for i in range(40)],
    "chat_pairs": [{"chosen": [turn("user", f"say {i}"), turn("assistant", f"{i} said")],
                    "rejected": [turn("user", f"say {i}"), turn("assistant", "no")]}
                   for i in range(40)],
    "prompts": [{"prompt": f"say {i}", "answer": str(i)} for i in range(40)],
}  # fmt: skip
READS = [
    ("llm/hf_tiny_kd", "chat"), ("llm/hf_tiny_kd", "completion"),
    ("llm/hf_tiny_full", "chat"), ("llm/hf_tiny_full", "completion"),
    ("llm/hf_tiny_lora", "completion"),
    ("llm/hf_tiny_dpo", "pairs"), ("llm/hf_tiny_dpo", "chat_pairs"),
    ("llm/hf_tiny_grpo", "prompts"), ("llm/hf_tiny_grpo", "chat"),
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama-shaped HF folder with a tokenizer and a chat template."""
    from freetx.data.corpus import builtin_documents
    from tests.hf_folders import make_folder, make_tokenizer

    path = make_folder(tmp_path_factory.mktemp("hf") / "llama", "llama3_2")
    make_tokenizer(path, builtin_documents()[:20])
    return path


@pytest.mark.parametrize("config,kind", READS)
def test_each_hf_tiny_config_reads_the_common_files_of_its_kind(folder, tmp_path, config, kind):
    source = tmp_path / f"{kind}.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS[kind]))
    overrides = [f"model_dir={folder}", f"dataset.source={source}", "dataset.val_fraction=0.2",
                 "rewards=[{_component_: freetx.objectives.ExactMatch}]", f"teacher_dir={folder}"]  # fmt: skip
    schema = load_recipe(recipe_for_config(config).name).schema
    known = [o for o in overrides if o.split("=")[0].split(".")[0] in schema.__dataclass_fields__]
    cfg = load_recipe_config(config, known, schema)
    tokenizer = checked_tokenizer(instantiate(cfg.tokenizer))
    data = instantiate(cfg.dataset, tokenizer=tokenizer, split="train")
    assert 20 < len(data) < 40  # every row read, ~80% of them in the training split
