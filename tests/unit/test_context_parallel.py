"""Context parallelism's pieces on one process: the load-balanced split of a sequence,
the mask of a rank's queries over the whole sequence (FlexAttention's block mask, CUDA's
kernel, against the dense mask, forward on CPU; both against the whole sequence's
attention), and the refusals made before any work."""

from __future__ import annotations

import warnings

import pytest
import torch

from freetx.distributed import MeshShape
from freetx.distributed.context_parallel import balanced_indices
from freetx.errors import ConfigError
from freetx.models.attention import AttentionSpec, attend, context_mask, document_mask
from freetx.models.free_transformer import FreeTransformer
from freetx.models.hf_generic import HFGenericModel
from freetx.models.transformer import Transformer
from freetx.training import check_context


@pytest.mark.parametrize("size", [1, 2, 4])
def test_each_position_is_on_one_rank_and_the_causal_work_is_balanced(size):
    length = 48
    parts = [balanced_indices(length, size, rank) for rank in range(size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    assert all(p.tolist() == sorted(p.tolist()) for p in parts)  # in order
    # a causal query at position i sees i + 1 keys: every rank gets the same sum
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1
    assert balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]


SPECS = [AttentionSpec(), AttentionSpec(window=5), AttentionSpec(softcap=2.0),
         AttentionSpec(window=5, softcap=2.0, scale=0.3)]  # fmt: skip
DOCUMENTS = torch.tensor([[0] * 7 + [1] * 9 + [2] * 5 + [-1] * 3, [0] * 20 + [1] * 4])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("packed", [False, True])
def test_a_ranks_queries_over_the_whole_sequence_are_the_whole_attentions_rows(spec, packed):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    documents = DOCUMENTS if packed else None
    dense = "sdpa_mask" if spec.softcap is None else "explicit"
    if packed:
        whole = attend(q, k, v, spec, mask=document_mask(documents, spec, kernel=dense))
    else:
        whole = attend(q, k, v, spec, kernel=dense)
    for rank in range(2):
        mine = balanced_indices(24, 2, rank)
        mask = context_mask(mine, 24, spec, documents, kernel=dense)
        rows = attend(q[:, :, mine], k, v, spec, mask=mask)
        assert (rows - whole[:, :, mine]).abs().max() <= 1e-5
        with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
            warnings.simplefilter("ignore")
            flex_mask = context_mask(mine, 24, spec, documents, kernel="flex")
            flex = attend(q[:, :, mine], k, v, spec, mask=flex_mask)
        assert (flex - rows).abs().max() <= 1e-5


def test_context_parallelism_takes_the_masked_kernel_on_cpu_and_flex_on_cuda():
    positions = balanced_indices(16, 2, 0)
    assert context_mask(positions, 16, AttentionSpec()).kernel == "sdpa_mask"
    assert context_mask(positions, 16, AttentionSpec(softcap=2.0)).kernel == "explicit"


def test_a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused():
    MeshShape(cp=4).check_sequence_length(64)
    with pytest.raises(ConfigError, match="does not divide into 8") as error:
        MeshShape(cp=4).check_sequence_length(60)
    assert "multiple of 8" in str(error.value)


@pytest.mark.parametrize("model", [FreeTransformer, HFGenericModel])
def test_models_that_cannot_compute_a_part_of_a_sequence_are_refused(model):
    check_context(Transformer, MeshShape(cp=2), 64)
    check_context(model, MeshShape())  # cp 1: nothing to split
    with pytest.raises(ConfigError, match="cannot compute a part") as error:
        check_context(model, MeshShape(cp=2), 64)
    assert "Set distributed.cp=1" in str(error.value)
