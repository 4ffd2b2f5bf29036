"""`freetx import`: an old DeepSpeed config's printed overrides, pasted after the recipe's
config, validate; a missing file is one paragraph."""

from __future__ import annotations

import json
import shlex

from tests.conftest import flat, run_freetx_here


def test_imported_deepspeed_overrides_validate(tmp_path):
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.3, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
    }))  # fmt: skip
    result = run_freetx_here("import", "deepspeed", str(ds_config), "--world-size", "2")
    assert result.returncode == 0, result.stderr
    overrides = shlex.split(result.stdout.splitlines()[0])
    assert "batch_size=16" in overrides and "distributed.strategy=zero2" in overrides
    assert "#   zero_optimization.overlap_comm: " in result.stdout
    checked = run_freetx_here("validate", "llm/tiny", "--world-size", "2", *overrides)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("llm/tiny: OK")


def test_import_of_a_missing_file_is_one_paragraph(tmp_path):
    result = run_freetx_here("import", "accelerate", str(tmp_path / "default_config.yaml"))
    assert result.returncode == 1
    assert "default_config.yaml does not exist" in flat(result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
