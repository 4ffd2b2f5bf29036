"""The generation engine (`freetx.models.engine`) on the native decoder: the tokens of the
static batch (today's generator) for every sampling, whatever the slot count, block size
and neighbours; one prefill per prompt group; rows that give their blocks back when the
pool runs out start again with the same tokens; the pool holds what the rows hold; the
paged cache's attention equals the dense cache's (grouped-query, sliding window with
soft-capping, multi-head latent attention); a compiled step gives the same tokens; bad
input is refused before any work."""

from __future__ import annotations

import pytest
import torch

from freetx.errors import ConfigError
from freetx.models.engine import EngineConfig
from freetx.models.generation import Draws, Sampling, generate
from freetx.models.kv_cache import KVCache
from freetx.models.paged_cache import BlockPool, PagedRows
from freetx.models.transformer import decoder
from tests.unit.test_generation import lively_decoder

PROMPTS = [[1, 5, 9, 12], [1, 7], [1, 3, 3, 3, 3, 8, 2, 4, 4, 6, 7, 9, 11, 13, 15, 17, 2]]
ROWS = [p for p in PROMPTS for _ in range(3)]  # three completions of each prompt
STATIC = EngineConfig(paged=False)


@pytest.fixture(scope="module")
def model():
    return lively_decoder()


def draws(rows: int = len(ROWS), steps: int = 30) -> Draws:
    return Draws.keyed([f"row {i}" for i in range(rows)], steps)


def same_completions(a, b) -> None:
    assert a.replies() == b.replies()
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ended, b.ended)


@pytest.mark.parametrize(
    "sampling", [Sampling(1.0, top_k=20), Sampling(0.0), Sampling(0.8, top_p=0.9)]
)
def test_the_engine_gives_the_static_batchs_tokens(model, sampling):
    for ends in ([], [3], [5, 7]):
        static = generate(model, ROWS, 30, sampling, ends, draws(), engine=STATIC)
        paged = generate(model, ROWS, 30, sampling, ends, draws())
        assert static.stats is None and paged.stats is not None
        same_completions(paged, static)
        assert paged.tokens.shape == static.tokens.shape
        torch.testing.assert_close(paged.entropy, static.entropy, atol=2e-2, rtol=1e-3)
        past_end = torch.arange(paged.entropy.shape[1])[None, :] >= paged.lengths[:, None]
        assert (paged.entropy[past_end] == 0).all()


@pytest.mark.parametrize(
    "engine",
    [EngineConfig(slots=1), EngineConfig(slots=4, block_size=4), EngineConfig(block_size=1),
     EngineConfig(slots=2, block_size=32)],
    ids=["one_slot", "four_slots_blocks_of_4", "blocks_of_1", "two_slots_one_block"],
)  # fmt: skip
def test_a_completion_does_not_depend_on_slots_block_size_or_neighbours(model, engine):
    sampling = Sampling(1.0)
    reference = generate(model, ROWS, 30, sampling, [3], draws())
    same_completions(generate(model, ROWS, 30, sampling, [3], draws(), engine=engine), reference)
    for i in (0, 4, 8):  # a row alone: its own draws, no neighbour
        alone = generate(model, [ROWS[i]], 30, sampling, [3], Draws(draws().uniforms[i : i + 1]))
        assert alone.replies()[0] == reference.replies()[i]


def test_each_prompt_group_is_read_once(model):
    out = generate(model, ROWS, 30, Sampling(1.0), [], draws())
    assert out.stats.prefills == len(PROMPTS)
    assert out.stats.prefill_tokens == sum(map(len, PROMPTS))  # the static batch: 9 x 17


def test_rows_give_blocks_back_when_the_pool_runs_out_and_repeat_their_tokens(model):
    sampling = Sampling(1.0)
    reference = generate(model, ROWS, 30, sampling, [], draws())
    small = EngineConfig(slots=6, block_size=4, kv_blocks=13)  # one row: 47 tokens, 12 blocks
    out = generate(model, ROWS, 30, sampling, [], draws(), engine=small)
    assert out.stats.restarted > 0 and out.stats.most_blocks <= 13
    same_completions(out, reference)


def test_the_pool_holds_the_tokens_the_rows_hold(model):
    """Rows that end early free their blocks for the others: the most held at once is
    what the live rows held, below the dense cache of every row at the longest length."""
    ends = [3, 5, 7, 11]
    out = generate(model, ROWS, 30, Sampling(1.0), ends, draws(), engine=EngineConfig(block_size=4))
    assert int(out.lengths.min()) < 30 <= int(out.lengths.max()) + 1
    dense_tokens = len(ROWS) * (max(map(len, PROMPTS)) + 30)
    assert out.stats.most_blocks * 4 < 0.8 * dense_tokens
    per_token = len(model.layers) * 2 * model.config.num_kv_heads * model.config.head_dim * 4
    assert out.stats.block_bytes == 4 * per_token  # keys and values of every layer, fp32


def paged_vs_dense(model, prompt_len=7, steps=6, block_size=4) -> tuple[float, float]:
    """A prompt then `steps` tokens one at a time through the paged cache and through the
    dense cache, two rows: the largest difference of every layer's attention output, and
    of the logits relative to their largest."""
    tokens = torch.randint(
        1, 40, (2, prompt_len + steps), generator=torch.Generator().manual_seed(3)
    )
    layers = len(model.layers)
    pool = BlockPool(layers, 16, block_size)
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # 16 tokens a row
    dense = KVCache(layers, prompt_len + steps, torch.zeros(2, dtype=torch.long))
    outputs: list[torch.Tensor] = []
    hooks = [block.attention.register_forward_hook(lambda m, i, o: outputs.append(o))
             for block in model.layers]  # fmt: skip
    logits = {"paged": [], "dense": []}
    with torch.no_grad():
        for t in [0, *range(prompt_len, prompt_len + steps)]:
            new = tokens[:, t : t + 1] if t else tokens[:, :prompt_len]
            logits["paged"].append(model(new, cache=PagedRows(pool, tables, torch.full((2,), t))))
            logits["dense"].append(model(new, cache=dense))
    for hook in hooks:
        hook.remove()
    # each call's layers in order, paged then dense: pair each paged layer with its dense
    calls = [outputs[i : i + layers] for i in range(0, len(outputs), layers)]
    attention = max(
        (a - b).abs().max().item()
        for paged, dense in zip(calls[0::2], calls[1::2])
        for a, b in zip(paged, dense)
    )
    a, b = torch.cat(logits["paged"], 1), torch.cat(logits["dense"], 1)
    return attention, ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    "fields",
    [{}, {"sliding_window": 5, "attn_logit_softcap": 20.0},
     {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8}],
    ids=["grouped_query", "window_softcap", "latent"],
)  # fmt: skip
def test_the_paged_caches_attention_equals_the_dense_caches(fields):
    torch.manual_seed(0)
    model = decoder(preset="tiny", vocab_size=40, max_seq_len=64, **fields).eval()
    attention, logits = paged_vs_dense(model)
    assert attention <= 1e-6 and logits <= 1e-6, (attention, logits)


def test_the_latent_models_pool_holds_the_compressed_latent():
    """DeepSeek's MLA caches kv_lora_rank + the rope key per token, as transformers: here
    16 + 8 floats per layer against 2 x heads x (nope + rope / v) expanded."""
    torch.manual_seed(0)
    fields = {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8}
    model = decoder(preset="tiny", vocab_size=40, max_seq_len=64, **fields).eval()
    out = generate(
        model, ROWS[:3], 6, Sampling(1.0), [], draws(3, 6), engine=EngineConfig(block_size=4)
    )
    assert out.stats.block_bytes == 4 * len(model.layers) * (16 + 8) * 4
    static = generate(model, ROWS[:3], 6, Sampling(1.0), [], draws(3, 6), engine=STATIC)
    same_completions(out, static)


def test_a_compiled_step_gives_the_eager_tokens():
    torch.manual_seed(0)
    model = decoder(preset="tiny", vocab_size=40, max_seq_len=64, num_layers=1).eval()
    rows, sampling = ROWS[:6], Sampling(1.0)
    eager = generate(model, rows, 8, sampling, [3], draws(6, 8), engine=EngineConfig(compile=False))
    compiled = generate(
        model, rows, 8, sampling, [3], draws(6, 8), engine=EngineConfig(compile=True)
    )
    same_completions(compiled, eager)


def test_a_longrope_model_takes_the_static_batch():
    """Its keys are computed again when a row grows past the short tables: no pool."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16, "factor": 4.0,
               "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}  # fmt: skip
    model = decoder(preset="tiny", vocab_size=40, max_seq_len=64, rope_scaling=scaling).eval()
    out = generate(model, ROWS[:2], 4, Sampling(1.0), [], draws(2, 4))
    assert out.stats is None


def test_bad_input_is_refused_before_any_work(model):
    with pytest.raises(ConfigError, match=r"up to 126 tokens .* max_seq_len=64"):
        generate(model, [[1] * 100], 26, Sampling(1.0), [], draws(1, 26))
    small = EngineConfig(kv_blocks=2, block_size=8)
    with pytest.raises(ConfigError) as caught:
        generate(model, ROWS, 30, Sampling(1.0), [], draws(), engine=small)
    message = str(caught.value)
    assert "engine.kv_blocks=2 blocks of 8 tokens hold 16 tokens" in message
    assert "a prompt of 17 and 30 new tokens): 6 blocks. Raise engine.kv_blocks to 6" in message


def test_estimate_counts_the_pool_by_the_engines_settings():
    """`freetx estimate`'s generation phase: kv_blocks blocks (or slots x the longest row)
    of every layer's keys and values, or MLA's latent, and a step's logits per slot."""
    from freetx.planning.estimate import GenerationPhase

    latent = {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8}
    for fields, per_token in (({}, 2 * 2 * 32), (latent, 16 + 8)):
        model = decoder(preset="tiny", vocab_size=40, max_seq_len=64, **fields)
        logits = 2 * 40 * 4
        found = GenerationPhase(64, 40, EngineConfig(slots=8)).cache_bytes(model, 2, 1)
        assert found == 8 * 3 * 16 * 4 * per_token * 2 + 8 * logits  # 3 blocks a slot
        pool = GenerationPhase(64, 40, EngineConfig(kv_blocks=10)).cache_bytes(model, 2, 1)
        assert pool == 10 * 16 * 4 * per_token * 2 + 64 * logits
    static = GenerationPhase(64, 40, EngineConfig(paged=False)).cache_bytes(decoder("tiny"), 4, 1)
    assert static == 64 * 40 * 4 * (2 * 2 * 32) * 4 + 64 * 2 * 259 * 4
