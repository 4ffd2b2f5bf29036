"""`freetx data show CONFIG [N]`: training sequences as the model sees them (the tokens
without loss in [brackets], packed documents separated), and what the split is made of
(samples -> sequences, padding), with why packing packed nothing when it did."""

from __future__ import annotations

import torch

from freetx.cli.data import LEGEND, render_sample
from freetx.data import ByteTokenizer
from freetx.data.packing import DataSummary, packed_sample
from freetx.data.seq_len import fixed_length_sample
from tests.conftest import flat, one_paragraph, run_freetx_here

SMALL = "dataset.num_builtin_examples=400"


def encoded(prompt: str, response: str) -> tuple[list[int], list[bool]]:
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode(prompt)]
    answer = [*tok.encode(response), tok.eos_id]
    return ids + answer, [False] * len(ids) + [True] * len(answer)


def test_a_padded_sample_shows_the_prompt_masked_and_the_padding_counted():
    sample = fixed_length_sample(encoded("Q: hi\n", "ok"), 16, ByteTokenizer().pad_id)
    assert render_sample(sample, ByteTokenizer()) == "[<bos>Q: hi\n]ok<eos>[<pad> x 7]"


def test_a_packed_sample_marks_its_document_boundaries():
    pack = [encoded("a?", "b"), encoded("c?", "dd")]
    sample = packed_sample(pack, 16, ByteTokenizer().pad_id)
    assert render_sample(sample, ByteTokenizer()) == (
        "[<bos>a?]b<eos> ‖ [<bos>c?]dd<eos>[<pad> x 7]"
    )


def test_a_text_window_is_trained_on_but_its_first_token():
    window = torch.tensor([256, *b"hello"])
    sample = {"input_ids": window[:-1], "labels": window[1:]}
    assert render_sample(sample, ByteTokenizer()) == "[<bos>]hello"


def test_packing_that_packs_nothing_says_why_and_how_to_fix():
    line, why = DataSummary(19017, 19017, 64, 880000, True, two_shortest=(36, 36)).lines()
    assert line == "data: 19,017 samples -> 19,017 sequences of 64 tokens, 27.7% padding (packed)"
    assert "packing packed nothing: no two samples fit in 64 positions" in why
    assert "36 + 36" in why and "dataset.seq_len=128" in why
    assert len(DataSummary(10, 4, 64, 200, True, two_shortest=(3, 4)).lines()) == 1


def test_data_show_renders_sequences_and_the_packing_summary():
    result = run_freetx_here("data", "show", "llm/instruct_tiny", "2", SMALL)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(LEGEND)
    assert out.count("--- sequence ") == 2 and "--- sequence 2 of " in out
    assert "[<bos>" in out and "Answer: ]" in out and "<eos>[<pad> x " in out
    assert "sequences of 64 tokens" in out and "padding (not packed)" in out


def test_data_show_with_packing_that_packs_nothing_says_so():
    result = run_freetx_here("data", "show", "llm/instruct_tiny", "1", SMALL, "dataset.packed=true")
    assert result.returncode == 0, result.stderr
    assert "data: packing packed nothing" in flat(result.stdout)
    packed = run_freetx_here(
        "data", "show", "llm/instruct_tiny", SMALL, "dataset.packed=true", "dataset.seq_len=128",
        "model.max_seq_len=128",
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr
    assert packed.stdout.count("--- sequence ") == 3 and " ‖ " in packed.stdout  # N: 3
    assert "packing packed nothing" not in packed.stdout


def test_data_show_with_a_count_that_is_not_a_number_is_refused():
    message = one_paragraph(run_freetx_here("data", "show", "llm/instruct_tiny", "two"))
    assert "'two' is neither a number of sequences" in message
    assert "freetx data show CONFIG [N] [key=value ...]" in message


def test_data_show_on_a_config_without_a_tokenized_dataset_says_so():
    result = run_freetx_here("data", "show", "ad/darkroom_tiny")
    assert result.returncode == 0 and "nothing to show" in result.stdout


def test_grpo_prompts_show_their_tokens_without_loss_and_their_fields():
    result = run_freetx_here("data", "show", "llm/grpo_tiny", "1", SMALL)
    assert result.returncode == 0, result.stderr
    assert "--- prompt 1 of" in result.stdout and "[<bos>How many letters" in result.stdout
    assert "fields: {'answer': " in result.stdout and "prompts ->" in result.stdout
