"""Knowledge distillation's loss without either model's whole logits
(freetx.objectives.distillation): each divergence at temperatures 1 and 2, in 3 uneven
chunks with ignored labels, equal to the whole-vocabulary formulas written plainly here
(values, and the gradients of the student's hidden states and head); 0 for a student that
is the teacher; a precomputed teacher's top-k at k = vocabulary size equal to the live
forward KL, and below it axolotl's formula; a head sliced by vocabulary (two slices, one
thread each); through a decoder's forward; the refused values and vocabularies."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from freetx.data.tokenizers import ByteTokenizer
from freetx.distributed import materialize
from freetx.errors import ConfigError
from freetx.models.protocol import OutputLayer
from freetx.models.transformer import decoder
from freetx.objectives import DistillationLoss, TeacherTokens, TeacherTopK
from freetx.objectives.distillation import check_same_vocabulary, teacher_top_k
from tests.unit.test_chunked_logprobs import ThreadSlice

VOCAB, DIM, TEACHER_DIM = 37, 8, 12
ROWS, LENGTH = 2, 7  # 14 tokens: 3 chunks of 5, 5, 4


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, LENGTH, DIM, generator=g)
    weight = torch.randn(VOCAB, DIM, generator=g) * 0.5
    teacher_hidden = torch.randn(ROWS, LENGTH, TEACHER_DIM, generator=g)
    teacher_weight = torch.randn(VOCAB, TEACHER_DIM, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[1, 6:] = -100  # padding
    return hidden, weight, teacher_hidden, teacher_weight, labels


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def formula(loss: DistillationLoss, logits, teacher_logits, labels):
    """The plain way: both models' whole logits, torch's log_softmax, the formulas:
    (total, ce, kd)."""
    mask = labels != -100
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    t = loss.temperature
    log_q, log_p = F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits / t, -1)
    p, q = log_p.exp(), log_q.exp()
    if loss.divergence == "forward_kl":
        per_token = (p * (log_p - log_q)).sum(-1)
    elif loss.divergence == "reverse_kl":
        per_token = (q * (log_q - log_p)).sum(-1)
    else:
        b = loss.beta
        log_m = (b * p + (1 - b) * q).log()
        per_token = b * (p * (log_p - log_m)).sum(-1) + (1 - b) * (q * (log_q - log_m)).sum(-1)
    kd = (per_token * mask).sum() * t * t
    return loss.ce_weight * ce + loss.kd_weight * kd, ce, kd


def direct(loss: DistillationLoss, hidden, weight, teacher_logits, labels):
    """`formula`'s values and gradients in the student's hidden states and head."""
    hidden, weight = leaves(hidden, weight)
    total, ce, kd = formula(loss, hidden @ weight.t(), teacher_logits, labels)
    total.backward()
    return total.detach(), ce.detach(), kd.detach(), hidden.grad, weight.grad


def chunked(loss, hidden, weight, teacher, labels, vocab=None, teacher_vocab=None):
    hidden, weight = leaves(hidden, weight)
    if isinstance(teacher, tuple) and not isinstance(teacher, TeacherTopK):
        t_hidden, t_weight = teacher
        t_layer = OutputLayer(lambda h: h @ t_weight.t(), (t_weight,), VOCAB, teacher_vocab)
        teacher = TeacherTokens(t_hidden, t_layer)
    layer = OutputLayer(lambda h: h @ weight.t(), (weight,), VOCAB, vocab)
    total, terms = loss.output_loss(labels, teacher)(hidden, layer)
    total.backward()
    return total.detach(), terms["ce"], terms["kd"], hidden.grad, weight.grad


def assert_close(got, want, tol=1e-5):
    names = ("total", "ce", "kd", "hidden's gradient", "head's gradient")
    for a, b, name in zip(got, want, names):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert (a - b).abs().max().item() <= tol * (b.abs().max().item() + 1), name


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_each_chunked_divergence_equals_the_whole_vocabulary_one(divergence, temperature):
    hidden, weight, t_hidden, t_weight, labels = batch()
    loss = DistillationLoss(0.3, 0.7, divergence, 0.4, temperature, num_chunks=3)
    got = chunked(loss, hidden, weight, (t_hidden, t_weight), labels)
    assert_close(got, direct(loss, hidden, weight, t_hidden @ t_weight.t(), labels))
    assert got[2] > 0


def test_ignored_tokens_send_no_gradient():
    hidden, weight, t_hidden, t_weight, labels = batch()
    labels[1] = -100
    loss = DistillationLoss(divergence="jsd", temperature=2.0, num_chunks=3)
    got = chunked(loss, hidden, weight, (t_hidden, t_weight), labels)
    assert (got[3][1] == 0).all() and (got[3][0, 3:] != 0).all()
    assert_close(got, direct(loss, hidden, weight, t_hidden @ t_weight.t(), labels))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_forward_kl_is_zero_with_zero_gradient_when_the_student_is_the_teacher(temperature):
    hidden, weight, _, _, labels = batch()
    loss = DistillationLoss(0.0, 1.0, temperature=temperature, num_chunks=3)
    total, _, kd, grad_hidden, grad_weight = chunked(loss, hidden, weight, (hidden, weight), labels)
    assert abs(total.item()) <= 1e-5 and abs(kd.item()) <= 1e-5
    assert grad_hidden.abs().max() <= 1e-6 and grad_weight.abs().max() <= 1e-6


def test_top_k_over_the_whole_vocabulary_equals_the_live_forward_kl():
    hidden, weight, t_hidden, t_weight, labels = batch()
    loss = DistillationLoss(num_chunks=3)
    logps = F.log_softmax(t_hidden @ t_weight.t(), -1)
    top = logps.topk(VOCAB, dim=-1)
    got = chunked(loss, hidden, weight, TeacherTopK(top.indices, top.values), labels)
    assert_close(got, chunked(loss, hidden, weight, (t_hidden, t_weight), labels))


def test_top_k_below_the_vocabulary_is_forward_kl_over_those_ids_only():
    """axolotl's kd plugin's: sum_k p_k (log p_k - log q_k), q over the whole vocabulary."""
    hidden, weight, t_hidden, t_weight, labels = batch()
    loss = DistillationLoss(ce_weight=0.0, kd_weight=1.0, num_chunks=3)
    top = F.log_softmax(t_hidden @ t_weight.t(), -1).topk(5, dim=-1)
    h, w = leaves(hidden, weight)
    log_q = F.log_softmax(h @ w.t(), -1).gather(-1, top.indices)
    want = (top.values.exp() * (top.values - log_q)).sum(-1)[labels != -100].sum()
    want.backward()
    got = chunked(loss, hidden, weight, TeacherTopK(top.indices, top.values), labels)
    assert_close(got, (want.detach(), got[1], want.detach(), h.grad, w.grad))


def test_teacher_top_k_in_chunks_is_the_log_softmaxs_k_largest_entries():
    _, _, t_hidden, t_weight, _ = batch()
    layer = OutputLayer(lambda h: h @ t_weight.t(), (t_weight,), VOCAB)
    top = teacher_top_k(TeacherTokens(t_hidden, layer), 5, num_chunks=3)
    want = F.log_softmax(t_hidden @ t_weight.t(), -1).topk(5, dim=-1)
    assert top.ids.shape == (ROWS, LENGTH, 5) and torch.equal(top.ids, want.indices)
    torch.testing.assert_close(top.logps, want.values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_top_k_refuses_divergences_that_need_the_whole_distribution(divergence):
    _, _, _, _, labels = batch()
    top = TeacherTopK(torch.zeros(ROWS, LENGTH, 4, dtype=torch.long), torch.zeros(ROWS, LENGTH, 4))
    with pytest.raises(ValueError, match="forward_kl at temperature 1"):
        DistillationLoss(divergence=divergence).output_loss(labels, top)
    with pytest.raises(ValueError, match="temperature=2.0"):
        DistillationLoss(temperature=2.0).output_loss(labels, top)


def test_under_no_grad_the_sums_are_the_same_and_keep_no_graph():
    hidden, weight, t_hidden, t_weight, labels = batch()
    loss = DistillationLoss(divergence="reverse_kl", temperature=2.0, num_chunks=3)
    layer = OutputLayer(lambda h: h @ weight.t(), (weight.requires_grad_(),), VOCAB)
    teacher = TeacherTokens(t_hidden, OutputLayer(lambda h: h @ t_weight.t(), (t_weight,), VOCAB))
    with torch.no_grad():
        total, terms = loss.output_loss(labels, teacher)(hidden, layer)
    want = direct(loss, hidden, weight.detach(), t_hidden @ t_weight.t(), labels)
    assert not total.requires_grad
    assert torch.allclose(total, want[0]) and torch.allclose(terms["kd"], want[2])


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_a_head_sliced_by_vocabulary_gives_the_whole_loss_and_gradients(divergence):
    hidden, weight, t_hidden, t_weight, labels = batch()
    loss = DistillationLoss(0.3, 0.7, divergence, temperature=2.0, num_chunks=3)
    split, results = 20, {}  # slices of 20 and 17 entries
    shared, barrier = {}, threading.Barrier(2)

    def rank(r, start, end):
        vocab = ThreadSlice(start, r, shared, barrier)
        teacher = (t_hidden, t_weight[start:end])
        results[r] = chunked(loss, hidden, weight[start:end], teacher, labels, vocab, vocab)

    threads = [threading.Thread(target=rank, args=a) for a in [(0, 0, split), (1, split, VOCAB)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total, ce, kd, grad_hidden, grad_weight = direct(
        loss, hidden, weight, t_hidden @ t_weight.t(), labels
    )
    for r in (0, 1):
        assert_close(results[r][:3], (total, ce, kd))
    # each rank's hidden gradient is its slice's part: tensor parallelism sums them
    assert_close([results[0][3] + results[1][3]], [grad_hidden])
    assert_close([torch.cat([results[0][4], results[1][4]])], [grad_weight])


def test_a_decoders_forward_returns_the_loss_in_place_of_the_logits():
    """The teacher's forward hands over its hidden states and head (`TeacherTokens` as its
    output loss); the student's returns the loss, equal to the whole logits' formulas."""
    models = []
    for seed in (3, 4):
        with torch.device("meta"):
            models.append(decoder(preset="tiny", num_layers=1, max_seq_len=16))
        materialize(models[-1], torch.device("cpu"), seed=seed)
    student, teacher = models
    teacher.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (2, 10), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, :3] = -100
    loss = DistillationLoss(divergence="reverse_kl", temperature=2.0, num_chunks=3)
    with torch.no_grad():
        teacher_logits = teacher(ids)
        tokens = teacher(ids, output_loss=TeacherTokens)

    def grads(total):
        student.zero_grad(set_to_none=True)
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}

    want, want_grads = grads(formula(loss, student(ids), teacher_logits, labels)[0])
    got, got_grads = grads(student(ids, output_loss=loss.output_loss(labels, tokens))[0])
    assert torch.allclose(got, want, atol=1e-5)
    for name, grad in got_grads.items():
        scale = want_grads[name].abs().max().item() + 1e-12
        assert (grad - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


def test_heads_of_other_sizes_are_refused():
    hidden, weight, t_hidden, t_weight, labels = batch()
    layer = OutputLayer(lambda h: h @ weight.t(), (weight,), VOCAB)
    teacher = TeacherTokens(t_hidden, OutputLayer(lambda h: h, (), VOCAB + 3))
    with pytest.raises(ValueError, match="37 entries and the teacher's 40"):
        DistillationLoss().output_loss(labels, teacher)(hidden, layer)


def problems(**values):
    return DistillationLoss.meaningless(values)


def test_meaningless_values_are_named_with_their_fix():
    assert problems() == {}
    assert "0 or more" in problems(ce_weight=-1)["ce_weight"]
    assert "both 0" in problems(ce_weight=0, kd_weight=0)["kd_weight"]
    assert "positive" in problems(temperature=0)["temperature"]
    assert "between 0 and 1" in problems(beta=1.5)["beta"]
    assert "set divergence=forward_kl" in problems(divergence="jsd", beta=0)["beta"]
    assert "set divergence=reverse_kl" in problems(divergence="jsd", beta=1)["beta"]
    assert "1 or more" in problems(num_chunks=0)["num_chunks"]
    for name, meant in [("kl", "forward_kl"), ("FKL", "forward_kl"), ("rkl", "reverse_kl"),
                        ("gkd", "jsd"), ("reverse-kl", "reverse_kl")]:  # fmt: skip
        assert f"did you mean {meant!r}" in problems(divergence=name)["divergence"], name
    with pytest.raises(ValueError, match="'temperature' is -1"):
        DistillationLoss(temperature=-1)


class Listed:
    """A tokenizer that lists its vocabulary (transformers')."""

    def __init__(self, vocab, path):
        self.vocab, self.path, self.vocab_size = vocab, path, len(vocab)

    def get_vocab(self):
        return dict(self.vocab)


def test_the_same_vocabulary_passes():
    vocab = {"a": 0, "b": 1, "c": 2}
    check_same_vocabulary(Listed(vocab, "/s"), Listed(vocab, "/t"), 3, 3)
    check_same_vocabulary(ByteTokenizer(), ByteTokenizer(), 259, 259)


def test_other_vocabularies_are_refused_naming_both_tokenizers():
    student, teacher = Listed({"a": 0, "b": 1}, "/models/small"), Listed({"b": 0, "a": 1}, "/t")
    with pytest.raises(ConfigError, match="2 tokens differ") as error:
        check_same_vocabulary(student, teacher, 2, 2)
    assert "Listed at /models/small (head: 2 entries)" in str(error.value)
    assert "Listed at /t" in str(error.value)
    with pytest.raises(ConfigError, match="259 and 3 tokens"):
        check_same_vocabulary(ByteTokenizer(), Listed({"a": 0, "b": 1, "c": 2}, "/t"), 259, 3)
    with pytest.raises(ConfigError, match="heads do not"):
        check_same_vocabulary(ByteTokenizer(), ByteTokenizer(), 259, 320)


def word_level_folder(folder, words):
    """A tokenizer folder freetx's HFTokenizer reads: a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models

    folder.mkdir()
    vocab = {word: i for i, word in enumerate([*words, "<eos>"])}
    Tokenizer(models.WordLevel(vocab, unk_token=words[0])).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    return str(folder)


def test_hf_tokenizers_of_one_size_but_other_tokens_are_refused(tmp_path):
    pytest.importorskip("tokenizers")
    from freetx.data.tokenizers import HFTokenizer

    student = HFTokenizer(word_level_folder(tmp_path / "student", ["a", "b", "c"]))
    same = HFTokenizer(word_level_folder(tmp_path / "same", ["a", "b", "c"]))
    other = HFTokenizer(word_level_folder(tmp_path / "other", ["a", "b", "x"]))
    check_same_vocabulary(student, same, 4, 4)
    with pytest.raises(ConfigError, match="2 tokens differ \\(e.g. 'c', 'x'\\)") as error:
        check_same_vocabulary(student, other, 4, 4)
    assert f"HFTokenizer at {tmp_path / 'other'} (head: 4 entries)" in str(error.value)


def test_the_loss_runs_on_fake_tensors():
    """`freetx estimate --measure` runs a step on fake tensors: chunks from sizes alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden, weight, t_hidden, t_weight, labels = batch()
        loss = DistillationLoss(divergence="jsd", num_chunks=3)
        total, _, _, grad_hidden, grad_weight = chunked(
            loss, hidden, weight, (t_hidden, t_weight), labels
        )
        assert total.shape == () and grad_hidden.shape == hidden.shape
        assert grad_weight.shape == weight.shape
