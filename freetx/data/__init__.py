"""Data: tokenizers, the built-in corpus, packed text, instruction, chat, preference and
prompt datasets, the letter-block task, AD's learning histories, crosscoders' activations,
sampling, the shard cache, and mixtures of datasets.

Datasets take rank and world size as arguments (never from the process group),
and import nothing from the rest of freetx but its errors.
"""

from freetx.data.activation_rows import ActivationRows, PlantedFeatures
from freetx.data.activations import (
    Activations,
    ActivationsConfig,
    RowLoading,
    SourceConfig,
    harvested_activations,
    planted_activations,
)
from freetx.data.batch import (
    DistillBatch,
    MixesSources,
    PreferenceBatch,
    RolloutBatch,
    SourcesOf,
    TokenBatch,
    collate_pairs,
    source_names,
    token_sample,
)
from freetx.data.chat import ChatDataset
from freetx.data.instruct import InstructDataset
from freetx.data.letter_block import LetterBlockDataset
from freetx.data.mixture import MadeOfParts, Mixture
from freetx.data.preference import PreferenceDataset, UnpairedPreferenceDataset
from freetx.data.prompts import PromptBatch, PromptDataset, collate_prompts
from freetx.data.sampling import (
    IGNORE_INDEX,
    EvalShard,
    GlobalBatchSampler,
    build_eval_loader,
    build_train_loader,
    micro_batch_size,
)
from freetx.data.shard_cache import ShardCache
from freetx.data.text import PackedTextDataset, read_documents
from freetx.data.tokenizers import (
    ByteTokenizer,
    HasHFForm,
    HFTokenizer,
    Tokenizer,
    checked_tokenizer,
    encoded_text,
    leading_bos,
    tokenizer_problem,
)

__all__ = [
    "IGNORE_INDEX",
    "Activations",
    "ActivationRows",
    "ActivationsConfig",
    "PlantedFeatures",
    "RowLoading",
    "SourceConfig",
    "ByteTokenizer",
    "ChatDataset",
    "EvalShard",
    "GlobalBatchSampler",
    "HasHFForm",
    "HFTokenizer",
    "Tokenizer",
    "InstructDataset",
    "LetterBlockDataset",
    "MixesSources",
    "MadeOfParts",
    "Mixture",
    "PackedTextDataset",
    "PreferenceDataset",
    "UnpairedPreferenceDataset",
    "PromptBatch",
    "PromptDataset",
    "collate_prompts",
    "ShardCache",
    "SourcesOf",
    "TokenBatch",
    "DistillBatch",
    "PreferenceBatch",
    "RolloutBatch",
    "collate_pairs",
    "build_eval_loader",
    "build_train_loader",
    "harvested_activations",
    "checked_tokenizer",
    "encoded_text",
    "leading_bos",
    "tokenizer_problem",
    "micro_batch_size",
    "token_sample",
    "planted_activations",
    "read_documents",
    "source_names",
]
