"""Knowledge distillation's loss: the labels' cross-entropy plus a divergence from a
teacher's distribution, a chunk of tokens at a time through both models' output layers.

A student learns a frozen teacher's next-token distribution (Hinton et al. 2015;
torchtune's `knowledge_distillation_*`, GKD): `DistillationLoss.output_loss(labels,
teacher)` is an `OutputLoss` (`freetx.models.OutputLoss`) that the student's forward
calls with its last hidden states and output layer. The teacher comes either live, as
its own last hidden states and output layer (`TeacherTokens`: what the teacher's forward
returns given `output_loss=TeacherTokens`), or precomputed, as its top-k log-probs per
position (`TeacherTopK`). Neither model's [B, T, vocab] logits are ever whole: the loss
is a `ChunkTerm` of the engine that `ChunkedCrossEntropy` runs on
(`freetx.models.chunked_loss`), which makes the student's logits a chunk of tokens at a
time, upcast to float32, and takes that chunk's gradients at once, so that nothing of a
chunk is kept for backward; the term makes the teacher's logits of the same chunk (its
head runs once per step).

Over a head sliced by vocabulary (tensor parallelism, `OutputLayer.vocab`) each rank
holds its slice of both models' logits (the same entries for both): the log-softmaxes'
normalizers and the divergences' sums over the vocabulary are reduced over the slices
(`VocabSlice.max` / `.sum`), as `sliced_cross_entropy` does; no logits are gathered.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset

from freetx.data import TokenBatch
from freetx.data.batch import TEACHER_IDS, TEACHER_LOGPS
from freetx.distributed import root_gathered
from freetx.errors import ConfigError
from freetx.fields import ReadsFiles, field_problems
from freetx.models.chunked_loss import (
    IGNORE_INDEX,
    WHOLE_VOCABULARY,
    Chunk,
    SumsBySource,
    default_num_chunks,
    log_sum_exp,
    loss_in_chunks,
    num_chunks_problem,
    over_chunks,
    sliced_cross_entropy,
)
from freetx.models.protocol import LMOutput, OutputLayer, VocabSlice
from freetx.objectives.cross_entropy import with_router_loss
from freetx.objectives.precompute import per_sample_table, samples_digest, stored_or_computed
from freetx.objectives.reference import FrozenCopy

# divergence -> what it is (its paper)
DIVERGENCES = {
    "forward_kl": "KL(teacher || student), Hinton et al. 2015, torchtune's",
    "reverse_kl": "KL(student || teacher), MiniLLM, Gu et al. 2024",
    "jsd": "generalized Jensen-Shannon with beta, GKD, Agarwal et al. 2024",
}
# the names users write for them: the did-you-mean of `meaningless`
OTHER_NAMES = {"kl": "forward_kl", "fkl": "forward_kl", "rkl": "reverse_kl", "gkd": "jsd"}


class TeacherTokens(NamedTuple):
    """A live teacher at each position: its last hidden states [B, T, d_teacher] (no
    gradient) and its output layer, over the same vocabulary as the student's. A
    `ProjectsInChunks` teacher's forward returns it given `output_loss=TeacherTokens`.
    Its `project` is called while the student's loss runs: its weights must be at hand
    then (under FSDP2, gathered)."""

    hidden: torch.Tensor
    layer: OutputLayer


class TeacherTopK(NamedTuple):
    """A precomputed teacher: at each position its top-k token ids [B, T, k] (int64) and
    its log-softmax at temperature 1 for those ids [B, T, k] (float32)."""

    ids: torch.Tensor
    logps: torch.Tensor


@torch.no_grad()
def teacher_top_k(teacher: TeacherTokens, k: int, num_chunks: int | None = None) -> TeacherTopK:
    """A live teacher's top-k log-probs at temperature 1 at each position, a chunk of
    tokens at a time (`teacher.precompute: top_k`): the log-softmax over the whole
    vocabulary (a sliced head's slices joined, one chunk at a time), its k largest
    entries and their ids. The same position's `TeacherTopK` with k = vocabulary size
    makes the loss the live forward KL."""
    chunks = num_chunks or default_num_chunks(teacher.layer.vocab_size)
    ids, logps = over_chunks(teacher.hidden, teacher.layer, chunks, _TopK(k)).per_token
    shape = (*teacher.hidden.shape[:-1], -1)
    return TeacherTopK(ids.view(shape), logps.view(shape))


class _TopK:
    """`teacher_top_k`'s `ChunkTerm`: a chunk's k largest log-probs and their ids."""

    weights = ()

    def __init__(self, k: int) -> None:
        self.k = k

    def chunk(self, logits, _rows, vocab: VocabSlice | None, _differentiate, _upstream) -> Chunk:
        if vocab is not None:
            logits = vocab.gather(logits)
        top = logits.log_softmax(dim=-1).topk(min(self.k, logits.shape[-1]), dim=-1)
        return Chunk((), (top.indices, top.values), None)


class DistillationLoss:
    """The distillation loss of a student's tokens, summed over its loss tokens (labels
    other than `ignore_index`; the recipe divides by the global count):

        ce_weight x cross-entropy of the labels (temperature 1)
        + kd_weight x T^2 x divergence(teacher, student) at temperature T

    both distributions at `temperature` T (softmax(logits / T)); the divergence per token
    is multiplied by T^2 (Hinton et al. 2015), which keeps its gradients' scale as T
    changes. With p the teacher's distribution and q the student's, `divergence`:

        forward_kl  KL(p || q) = sum p (log p - log q), the teacher's mass covered
                    (torchtune's `ForwardKLLoss` minus the teacher's entropy, which has
                    no gradient: here 0 where the student is the teacher)
        reverse_kl  KL(q || p) = sum q (log q - log p), mode-seeking
        jsd         GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024),
                    P the teacher, Q the student, as GKD and TRL write it:
                    beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q;
                    beta in (0, 1) (at 0 and 1 it is 0 for any student; TRL's
                    beta = 0 and 1 are forward_kl and reverse_kl here)

    A precomputed teacher (`TeacherTopK`, axolotl's kd plugin's semantics) has only its
    top-k log-probs at temperature 1: the divergence is forward KL over those k ids,
    sum_k p_k (log p_k - log q_k), with the student's log-softmax over the whole
    vocabulary at temperature 1 (k = vocabulary size: the live forward KL); reverse_kl,
    jsd and a temperature other than 1 need the teacher's whole distribution and are
    refused for it. `num_chunks`: the logits a chunk of tokens at a time (None: by the
    vocabulary size, `default_num_chunks`).
    """

    def __init__(
        self,
        ce_weight: float = 0.5,
        kd_weight: float = 0.5,
        divergence: str = "forward_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        num_chunks: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.ce_weight, self.kd_weight, self.divergence = ce_weight, kd_weight, divergence
        self.beta, self.temperature = beta, temperature
        self.num_chunks, self.ignore_index = num_chunks, ignore_index
        problems = field_problems(DistillationLoss, vars(self))
        if problems:
            raise ValueError(" ".join(problems))

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values the loss would read as something else, by key: why, and the fix
        (`freetx validate` and every run check a config's `loss:` node with it)."""
        found = num_chunks_problem(values)
        for key in ("ce_weight", "kd_weight"):
            if not values.get(key, 0.5) >= 0:
                found[key] = "it weighs its term of the loss; set 0 or more (0.5)."
        if values.get("ce_weight", 0.5) == 0 and values.get("kd_weight", 0.5) == 0:
            found["kd_weight"] = (
                "ce_weight and kd_weight are both 0, so the loss is 0 and nothing learns; set "
                "kd_weight above 0 (0.5), ce_weight too for the labels' cross-entropy."
            )
        if not values.get("temperature", 1.0) > 0:
            found["temperature"] = (
                "both models' logits are divided by it before the softmax; set a positive "
                "one (1.0 keeps them; 2.0 softens them)."
            )
        kind = values.get("divergence", "forward_kl")
        beta = values.get("beta", 0.5)
        if kind not in DIVERGENCES:
            close = [OTHER_NAMES[str(kind).lower()]] if str(kind).lower() in OTHER_NAMES else []
            close = close or difflib.get_close_matches(str(kind), DIVERGENCES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(f"{name} ({what})" for name, what in DIVERGENCES.items())
            found["divergence"] = f"there is no such divergence{hint}; set one of: {known}."
        if not 0 <= beta <= 1:
            found["beta"] = (
                "it is the jsd's mixture weight of the teacher, M = beta P + (1 - beta) Q; set "
                "one between 0 and 1 (0.5)."
            )
        elif kind == "jsd" and beta in (0, 1):
            same = "forward_kl" if beta == 0 else "reverse_kl"
            found["beta"] = (
                f"the jsd at beta {beta} is 0 for any student (TRL's GKD reads it as "
                f"{same}); set divergence={same}, or a beta between 0 and 1 (0.5)."
            )
        return found

    def output_loss(self, labels: torch.Tensor, teacher: TeacherTokens | TeacherTopK, sources=None):
        """The `OutputLoss` of a batch: called with the student's last hidden states
        [B, T, d] and output layer, it returns (total, {"ce": ce_sum, "kd": kd_sum}):
        the loss summed over the loss tokens, differentiable in the hidden states and
        the layer's trained parameters, and its two terms' sums (unweighted, kd with
        its T^2; detached, to log). `labels` [B, T] (`ignore_index` where no loss)."""
        if isinstance(teacher, TeacherTopK):
            refused = self.divergence != "forward_kl" or self.temperature != 1
            if refused:
                raise ValueError(
                    f"a precomputed teacher's top-k log-probs (teacher.precompute: top_k) "
                    f"hold part of its distribution at temperature 1 only, so only "
                    f"forward_kl at temperature 1 can be taken over them; this loss has "
                    f"divergence={self.divergence}, temperature={self.temperature}. Set "
                    "divergence=forward_kl and temperature=1.0, or use the live teacher."
                )
            if teacher.ids.shape != teacher.logps.shape or teacher.ids.shape[:2] != labels.shape:
                raise ValueError(
                    f"the teacher's top-k ids {tuple(teacher.ids.shape)} and log-probs "
                    f"{tuple(teacher.logps.shape)} must both be [B, T, k] for labels "
                    f"{tuple(labels.shape)}: precompute them over the same batches."
                )
        elif teacher.hidden.shape[:2] != labels.shape:
            raise ValueError(
                f"the teacher's hidden states {tuple(teacher.hidden.shape)} are not [B, T, d] "
                f"for labels {tuple(labels.shape)}: run the teacher on the student's input ids."
            )
        return _OverChunks(self, labels, teacher, sources)

    def divergence_terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """Each vocabulary entry's term of the divergence [N, V] (their sum over the
        vocabulary is the divergence), from the teacher's log-probs `log_p` and the
        student's `log_q`; 0 where the distribution that weighs it is 0."""
        p, q = log_p.exp(), log_q.exp()
        if self.divergence == "forward_kl":
            return torch.where(p > 0, p * (log_p - log_q), 0.0)
        if self.divergence == "reverse_kl":
            return torch.where(q > 0, q * (log_q - log_p), 0.0)
        log_m = torch.logaddexp(log_p + math.log(self.beta), log_q + math.log(1 - self.beta))
        teacher = torch.where(p > 0, p * (log_p - log_m), 0.0)
        student = torch.where(q > 0, q * (log_q - log_m), 0.0)
        return self.beta * teacher + (1 - self.beta) * student


class Distill:
    """kd_fsdp2's objective, called as the SFT recipes call their loss: `loss(model,
    input_ids, labels, **inputs)` -> (the `DistillationLoss` summed over the loss tokens,
    its parts' sums: ce, kd; a mixture's `loss/<source>`). A live `teacher` (a `FrozenCopy`)
    runs first, under no_grad; its head stays gathered while the student's loss projects
    its hidden states. A precomputed one's top-k comes with the batch (`teacher_top_k`)."""

    def __init__(self, loss: DistillationLoss, teacher: FrozenCopy | None) -> None:
        self.loss, self.teacher = loss, teacher

    def __call__(self, model, input_ids, labels, teacher_top_k=None, sources=None, **inputs):
        # sources: a mixture's, which the loss sums by (the models never see them)
        if teacher_top_k is not None:
            output_loss = self.loss.output_loss(labels, TeacherTopK(*teacher_top_k), sources)
            output = model(input_ids, output_loss=output_loss, **inputs)
        else:
            teacher = self.teacher.run(lambda m: m(input_ids, output_loss=TeacherTokens, **inputs))
            with root_gathered(self.teacher.model):
                output_loss = self.loss.output_loss(labels, teacher, sources)
                output = model(input_ids, output_loss=output_loss, **inputs)
        total, parts = output[0] if isinstance(output, LMOutput) else output
        return with_router_loss(
            output, total, dict(parts), (labels != self.loss.ignore_index).sum()
        )

    evaluate = __call__


class _OverChunks:
    """`DistillationLoss.output_loss`'s `OutputLoss` (its docstring) and the `ChunkTerm`
    it runs `loss_in_chunks` with: a chunk's cross-entropy and divergence, weighed by
    ce_weight and kd_weight."""

    def __init__(self, loss: DistillationLoss, labels, teacher, sources: SumsBySource | None):
        self.loss, self.labels, self.teacher, self.sources = loss, labels, teacher, sources
        self.weights = (loss.ce_weight, loss.kd_weight)

    def __call__(self, hidden: torch.Tensor, layer: OutputLayer):
        if isinstance(self.teacher, TeacherTokens):
            self.check_heads(layer, self.teacher.layer)
        chunks = self.loss.num_chunks or default_num_chunks(layer.vocab_size)
        total, ce, kd, *per_token = loss_in_chunks(hidden, layer, chunks, self)
        parts = {"ce": ce, "kd": kd}
        if self.sources is not None:  # a mixture's: each source's loss, `loss/<name>`
            mask = self.labels != self.loss.ignore_index
            parts.update(self.sources.sums(per_token[0].view(self.labels.shape), mask))
        return total, parts

    @staticmethod
    def check_heads(student: OutputLayer, teacher: OutputLayer) -> None:
        """Refuse heads that do not share a vocabulary, or sliced unlike each other."""
        if student.vocab_size != teacher.vocab_size:
            raise ValueError(
                f"the student's head has {student.vocab_size} entries and the teacher's "
                f"{teacher.vocab_size}: distillation compares their distributions entry by "
                "entry; pick a teacher over the student's vocabulary (check_same_vocabulary)."
            )
        if (student.vocab is None) != (teacher.vocab is None):
            raise ValueError(
                "one model's head is sliced by vocabulary (tensor parallelism) and the "
                "other's is not: slice both heads alike (the same tp plan), so that each rank "
                "holds the same entries of both models' logits."
            )

    def chunk(self, logits, rows: slice, vocab: VocabSlice | None, differentiate, _upstream):
        """A chunk's two terms (`ChunkTerm`) and, where it will `differentiate`, the
        gradient of their weighted sum in the student's logits (the labels'
        cross-entropy through `sliced_cross_entropy`, one slice where the head is whole)."""
        loss, vocab, labels = self.loss, vocab or WHOLE_VOCABULARY, self.labels.flatten()[rows]
        ce, grad = sliced_cross_entropy(logits, labels, loss.ignore_index, vocab)
        kd, grad_kd = self.chunk_divergence(logits, labels, rows, vocab, differentiate)
        if differentiate:
            grad = loss.ce_weight * grad + loss.kd_weight * grad_kd
        # each token's loss, where a mixture's sources sum it
        per_token = () if self.sources is None else (loss.ce_weight * ce + loss.kd_weight * kd,)
        return Chunk((ce.sum(), kd.sum()), per_token, grad if differentiate else None)

    def chunk_divergence(self, logits, labels, rows: slice, vocab: VocabSlice, differentiate):
        """A chunk's divergence at each of its tokens (flat rows `rows`; 0 where no loss),
        times T^2, and, where it will `differentiate`, its gradient in the student's logits (this
        rank's slice [N, V/tp] float32; else None). The student's normalizer (log-sum-exp)
        enters as a leaf of its own: its gradient, summed over the slices, adds softmax
        times it to each slice's (the log-softmax's Jacobian)."""
        temperature = self.loss.temperature
        valid = labels != self.loss.ignore_index
        scaled = (logits / temperature).requires_grad_(bool(differentiate))
        normalizer = log_sum_exp(scaled.detach(), vocab).requires_grad_(bool(differentiate))
        with torch.enable_grad() if differentiate else torch.no_grad():
            log_q = scaled - normalizer[:, None]
            terms = self.teacher_terms(log_q, rows, vocab)
            per_token = terms.sum(dim=-1) * valid * temperature**2
            kd = vocab.sum(per_token.detach())
            if not differentiate:
                return kd, None
            grad_scaled, grad_normalizer = torch.autograd.grad(
                per_token.sum(), (scaled, normalizer)
            )
        with torch.no_grad():
            softmax = (scaled - normalizer[:, None]).exp()
            grad = (grad_scaled + vocab.sum(grad_normalizer)[:, None] * softmax) / temperature
        return kd, grad

    def teacher_terms(self, log_q, rows: slice, vocab: VocabSlice) -> torch.Tensor:
        """The divergence's terms of a chunk against the teacher, on this rank's slice:
        [N, V/tp] for a live teacher, [N, k] over the top-k ids (those on this slice)."""
        teacher = self.teacher
        if isinstance(teacher, TeacherTopK):
            ids = teacher.ids.flatten(0, 1)[rows].long() - vocab.start
            here = (ids >= 0) & (ids < log_q.shape[-1])
            log_p = teacher.logps.flatten(0, 1)[rows].float()
            p, picked = log_p.exp(), log_q.gather(1, ids.clamp(0, log_q.shape[-1] - 1))
            return torch.where(here & (p > 0), p * (log_p - picked), 0.0)
        with torch.no_grad():
            hidden = teacher.hidden.flatten(0, -2)[rows]
            logits = teacher.layer.project(hidden).float() / self.loss.temperature
            log_p = logits - log_sum_exp(logits, teacher.layer.vocab or WHOLE_VOCABULARY)[:, None]
        return self.loss.divergence_terms(log_p, log_q)


@runtime_checkable
class ListsVocabulary(Protocol):
    """A tokenizer that lists its vocabulary (transformers' and `tokenizers`' do):
    token -> id."""

    def get_vocab(self) -> dict[str, int]: ...


def vocabulary_of(tokenizer: Any) -> dict[str, int] | None:
    """A tokenizer's token -> id: its own list (`ListsVocabulary`), else the
    tokenizer.json it was read from (`ReadsFiles`: freetx's `HFTokenizer`), its model's
    vocabulary and added tokens; None for one with neither (freetx's `ByteTokenizer`)."""
    if isinstance(tokenizer, ListsVocabulary):
        return tokenizer.get_vocab()
    files = tokenizer.files_read if isinstance(tokenizer, ReadsFiles) else []
    for file in files:
        if Path(file).name == "tokenizer.json":
            spec = json.loads(Path(file).read_text(encoding="utf-8"))
            vocab = spec.get("model", {}).get("vocab", {})
            if isinstance(vocab, list):  # a Unigram model's [piece, score] pairs
                vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
            added = {token["content"]: token["id"] for token in spec.get("added_tokens", [])}
            return {**vocab, **added}
    return None


def _describe(tokenizer: Any, vocab_size: int) -> str:
    """A tokenizer as a user named it: its class, its path where it has one, its size."""
    path = getattr(tokenizer, "path", None)
    where = f" at {path}" if path else ""
    return f"{type(tokenizer).__name__}{where} (head: {vocab_size} entries)"


def check_same_vocabulary(
    student_tokenizer: Any, teacher_tokenizer: Any, student_vocab_size: int, teacher_vocab_size: int
) -> None:
    """Refuse, before launch, a teacher whose vocabulary is not the student's: their
    token -> id maps where both tokenizers have one (`vocabulary_of`), else their sizes,
    and their heads' sizes (distillation compares the two distributions entry by entry,
    so entry i must be the same token in both)."""
    tokenizers = (student_tokenizer, teacher_tokenizer)
    student_vocab, teacher_vocab = (vocabulary_of(t) for t in tokenizers)
    if student_vocab is not None and teacher_vocab is not None:
        moved = {t for t, i in student_vocab.items() if teacher_vocab.get(t) != i}
        moved |= set(teacher_vocab) - set(student_vocab)
        example = ", ".join(repr(t) for t in sorted(moved)[:3])
        differ, how = bool(moved), f"{len(moved)} tokens differ (e.g. {example})"
    else:
        sizes = [t.vocab_size for t in tokenizers]
        differ, how = (
            sizes[0] != sizes[1],
            f"their vocabularies have {sizes[0]} and {sizes[1]} tokens",
        )
    if not differ and student_vocab_size != teacher_vocab_size:
        differ, how = True, "the tokenizers agree but the models' heads do not"
    if differ:
        raise ConfigError(
            f"the student's tokenizer {_describe(student_tokenizer, student_vocab_size)} and "
            f"the teacher's {_describe(teacher_tokenizer, teacher_vocab_size)} do not share a "
            f"vocabulary: {how}. Distillation compares the two models' next-token "
            "distributions entry by entry, so both must map every token to the same id. "
            "Pick a teacher of the student's family (the same tokenizer), or point the "
            "student's tokenizer at the teacher's."
        )


# -- a precomputed teacher (`teacher.precompute: top_k`) ------------------------------------
TEACHER_FOLDER = "teacher_topk"  # in output_dir: one file per split


def check_top_k(top_k: int, vocab_size: int | None) -> None:
    """A precomputed teacher keeps its `top_k` most likely tokens per position, so there
    must be as many in its vocabulary (`vocab_size`; None: not known before it is built).
    Refused before any data is prepared."""
    if vocab_size is not None and top_k > vocab_size:
        raise ConfigError(
            f"teacher.top_k={top_k} keeps the teacher's {top_k} most likely tokens per "
            f"position, and its vocabulary has {vocab_size} tokens.",
            fix=f"Set teacher.top_k to {vocab_size} or fewer (64 is the default), or use the "
            "live teacher (teacher.precompute=none), which compares whole distributions.",
        )


class WithTeacherTopK(Dataset):
    """A token dataset whose samples carry their teacher's top-k: `table` holds "ids"
    [samples, T, k] (int32) and "logps" [samples, T, k] (float32), in the dataset's order."""

    def __init__(self, dataset: Dataset, table: dict[str, torch.Tensor]) -> None:
        self.dataset, self.table = dataset, table

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, logps = self.table["ids"][index], self.table["logps"][index]
        return {**self.dataset[index], TEACHER_IDS: ids, TEACHER_LOGPS: logps}


def with_teacher_top_k(
    teacher: FrozenCopy,
    dataset: Dataset,
    split: str,
    identity: dict[str, Any],
    output_dir: str | Path,
    samples_per_pass: int,
    k: int,
    say: Callable[[str], None],
) -> WithTeacherTopK:
    """`dataset` with the teacher's top-k log-probs at every position of every sample
    (`teacher_top_k`), computed once: read from output_dir/teacher_topk/<split>.safetensors
    when it was made for the same data (a digest of every sample's tokens), k and
    `identity` (the teacher's model and weights), else computed over all data-parallel
    ranks (`samples_per_pass` samples per forward over all ranks), gathered, and written
    there by rank 0. It holds samples x seq_len x k x 8 bytes."""
    path = Path(output_dir) / TEACHER_FOLDER / f"{split}.safetensors"
    key = json.dumps(
        {"split": split, "data": samples_digest(dataset), "top_k": k, **identity}, sort_keys=True
    )

    def top_k(batch: TokenBatch) -> dict[str, torch.Tensor]:
        inputs = batch.model_inputs()
        tokens = teacher.run(lambda m: m(batch.input_ids, output_loss=TeacherTokens, **inputs))
        with root_gathered(teacher.model):  # its head projects outside its forward
            top = teacher.run(lambda _: teacher_top_k(tokens, k, teacher.num_chunks))
        return {"ids": top.ids.int(), "logps": top.logps}

    table = stored_or_computed(
        path,
        key,
        lambda: per_sample_table(
            dataset, top_k, TokenBatch.collate, teacher.plan, samples_per_pass
        ),
        teacher.plan,
        say,
        f"teacher: top-{k} log-probs of {len(dataset)} {split} samples",
    )
    return WithTeacherTopK(dataset, table)
